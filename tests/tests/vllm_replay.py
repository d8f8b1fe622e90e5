"""vLLM's own KV event publisher (vllm.distributed.kv_events.ZmqEventPublisher: a libzmq PUB and
its replay ROUTER) made to drop batches, for tests/tests/real_vllm.rs.

Usage: python vllm_replay.py PUB_PORT REPLAY_ENDPOINT METRICS_URL INVENTORY_PID BATCHES

Publishes one block until the inventory holds it (subscribed), stops the inventory (SIGSTOP),
publishes BATCHES batches of 64 blocks through a PUB whose high-water mark is 2, so libzmq drops
what the stopped subscriber cannot take, resumes the inventory (SIGCONT), and republishes the
last batch until the inventory holds every block (the replays filling the gaps) or 60 s pass.
Prints the inventory's block count as `blocks N`.
"""
import os
import signal
import sys
import time
import urllib.request

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

PER = 64


def blocks(url: str) -> int:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith('kvroute_index_blocks{ep="0"'):
            return int(float(line.split()[-1]))
    return 0


def batch(first: int, n: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(range(first, first + n)), parent_block_hash=None,
        token_ids=list(range(16 * n)), block_size=16, lora_id=None, medium="GPU",
        lora_name=None)])


def main() -> None:
    port, replay, url, pid, n = (int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                 int(sys.argv[5]))
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=replay, hwm=2,
                            buffer_steps=100_000)
    try:
        end = time.time() + 60
        while blocks(url) < 1:
            if time.time() > end:
                sys.exit("the inventory never subscribed")
            pub.publish(batch(1, 1))
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(n):
                pub.publish(batch(1000 + i * PER, PER))
            # Until the publisher thread has sent every batch (it marks each done once libzmq
            # took it or dropped it at the high-water mark).
            end = time.time() + 60
            while pub._event_queue.unfinished_tasks and time.time() < end:
                time.sleep(0.01)
        finally:
            os.kill(pid, signal.SIGCONT)
        want, end = 1 + n * PER, time.time() + 60
        while blocks(url) < want and time.time() < end:
            pub.publish(batch(1000 + (n - 1) * PER, PER))
            time.sleep(0.1)
        print(f"blocks {blocks(url)}", flush=True)
    finally:
        pub.shutdown()


if __name__ == "__main__":
    main()
