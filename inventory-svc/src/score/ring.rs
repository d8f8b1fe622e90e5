//! Consistent-hash ring with 150 virtual nodes per endpoint, for sticky routing on a miss.
//!
//! Points are XXH3-64 of `"<ip:port>#<vnode>"`, so the ring only depends on endpoint addresses:
//! adding or removing one endpoint moves about 1/N of the affinity keys, and every replica of the
//! service builds the same ring.

use xxhash_rust::xxh3::xxh3_64;

/// Virtual nodes per endpoint.
pub const VNODES: usize = 150;

/// Sorted ring points `(hash, endpoint index)`.
#[derive(Clone, Debug, Default)]
pub struct HashRing {
    points: Vec<(u64, usize)>,
}

impl HashRing {
    /// Builds the ring over endpoint addresses (their order gives the endpoint indexes).
    pub fn new(addrs: &[String]) -> HashRing {
        let mut points = Vec::with_capacity(addrs.len() * VNODES);
        for (i, a) in addrs.iter().enumerate() {
            for v in 0..VNODES {
                points.push((xxh3_64(format!("{a}#{v}").as_bytes()), i));
            }
        }
        points.sort_unstable();
        HashRing { points }
    }

    /// Hash of an affinity key (tenant, or tenant + model).
    pub fn key_hash(key: &str) -> u64 {
        xxh3_64(key.as_bytes())
    }

    /// The first endpoint clockwise from `h` that `ok` accepts.
    pub fn lookup(&self, h: u64, ok: impl Fn(usize) -> bool) -> Option<usize> {
        if self.points.is_empty() {
            return None;
        }
        let start = self.points.partition_point(|(p, _)| *p < h);
        let n = self.points.len();
        (0..n)
            .map(|k| self.points[(start + k) % n].1)
            .find(|&i| ok(i))
    }
}
