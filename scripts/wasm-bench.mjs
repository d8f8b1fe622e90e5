// Times block hashing inside V8 (the runtime Envoy uses) by calling the filter module's
// kvroute_bench_keys export. Every proxy-wasm import is stubbed to return 0: the export
// touches none of them. Usage: node scripts/wasm-bench.mjs path/to/kvroute_filter.wasm
import { readFileSync } from "node:fs";

const ALGOS = ["sha256_cbor", "xxhash_cbor", "sha256_sglang", "blockhash_trtllm", "tokens"];
const module = new WebAssembly.Module(readFileSync(process.argv[2]));
const imports = {};
for (const imp of WebAssembly.Module.imports(module)) {
  imports[imp.module] ??= {};
  if (imp.kind === "function") imports[imp.module][imp.name] = () => 0;
}
const { exports } = new WebAssembly.Instance(module, imports);
if (typeof exports.kvroute_bench_keys !== "function") {
  console.error("the module has no kvroute_bench_keys export: rebuild it with scripts/build-wasm.sh");
  process.exit(1);
}
const out = {};
for (const [i, algo] of ALGOS.entries()) {
  out[algo] = {};
  for (const tokens of [1024, 32768]) {
    exports.kvroute_bench_keys(i, tokens, 3); // warm-up: V8 tiers up hot functions
    let reps = 1;
    let ms = 0;
    // Grow the repetition count until one measurement takes at least 300 ms (bounded).
    for (let round = 0; round < 20; round++) {
      const t0 = performance.now();
      exports.kvroute_bench_keys(i, tokens, reps);
      ms = performance.now() - t0;
      if (ms >= 300) break;
      reps *= 2;
    }
    const keysPerSec = ((tokens / 16) * reps) / (ms / 1000);
    out[algo][tokens] = Math.round(keysPerSec);
  }
}
console.log(JSON.stringify(out));
