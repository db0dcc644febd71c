//! Communication cost on a placement: `world` ranks packed onto nodes, the flows of one round
//! sharing each node's egress and ingress, the all-reduce the communicator would pick (ring or
//! recursive doubling), the loss exchange, the gradient sync and pipeline point-to-point; and
//! the bytes each sends and the CPU passes over the gradient outside the wire.

use std::collections::BTreeMap;

use lockstep_comm::Algorithm;

use super::stages::StageSize;
use super::{Cluster, Layout, Link, Workload};

/// Time and bytes of some communication.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Cost {
    pub(super) seconds: f64,
    /// Mean payload bytes sent per rank of the groups involved.
    pub(super) bytes_per_rank: f64,
}

impl std::ops::Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            seconds: self.seconds + o.seconds,
            bytes_per_rank: self.bytes_per_rank + o.bytes_per_rank,
        }
    }
}

/// `world` ranks packed onto the nodes of a cluster.
pub(super) struct Placement<'a> {
    cluster: &'a Cluster,
    pub(super) nodes_used: usize,
}

impl<'a> Placement<'a> {
    pub(super) fn new(cluster: &'a Cluster, world: usize) -> Self {
        Self {
            cluster,
            nodes_used: world.div_ceil(cluster.workers_per_node).max(1),
        }
    }

    fn node(&self, rank: usize) -> usize {
        rank / self.cluster.workers_per_node
    }

    pub(super) fn transport(&self) -> &'static str {
        if self.nodes_used == 1 {
            "shm"
        } else {
            "tcp"
        }
    }

    fn link(&self, a: usize, b: usize) -> Link {
        if self.node(a) != self.node(b) {
            self.cluster.inter
        } else if self.nodes_used == 1 {
            self.cluster.shm
        } else {
            self.cluster.intra
        }
    }

    /// Seconds each flow `(from, to, bytes)` of one round needs to deliver its message, the flows
    /// crossing nodes sharing each node's egress and ingress.
    /// `fresh`: the links were idle before this round, so their buckets are full.
    fn flow_seconds(&self, flows: &[(usize, usize, f64)], fresh: bool) -> Vec<f64> {
        let mut egress: BTreeMap<usize, usize> = BTreeMap::new();
        let mut ingress: BTreeMap<usize, usize> = BTreeMap::new();
        let crosses = |a: usize, b: usize| self.node(a) != self.node(b);
        for &(a, b, bytes) in flows {
            if bytes > 0.0 && crosses(a, b) {
                *egress.entry(self.node(a)).or_default() += 1;
                *ingress.entry(self.node(b)).or_default() += 1;
            }
        }
        flows
            .iter()
            .map(|&(a, b, bytes)| {
                let share = if crosses(a, b) {
                    let out = egress.get(&self.node(a)).copied().unwrap_or(1);
                    let inc = ingress.get(&self.node(b)).copied().unwrap_or(1);
                    out.max(inc) as f64
                } else {
                    1.0
                };
                let link = self.link(a, b);
                if fresh {
                    link.first_message_seconds(bytes, share)
                } else {
                    link.message_seconds(bytes, share)
                }
            })
            .collect()
    }

    /// Seconds until every flow of one round has delivered its message.
    fn round_seconds(&self, flows: &[(usize, usize, f64)], fresh: bool) -> f64 {
        self.flow_seconds(flows, fresh)
            .into_iter()
            .fold(0.0, f64::max)
    }

    /// All-reduce of `elems` elements of `esz` bytes, run at once by every group in `groups`
    /// (global ranks in group order, all of one size), with the algorithm the communicator picks.
    /// `fresh`: the first round finds the links' buckets full (the step's first large message).
    fn all_reduce(
        &self,
        groups: &[Vec<usize>],
        elems: usize,
        esz: usize,
        w: &Workload,
        fresh: bool,
    ) -> Cost {
        let n = groups.first().map_or(1, Vec::len);
        if n <= 1 || elems == 0 {
            return Cost::default();
        }
        let ring = match w.algorithm() {
            Algorithm::Auto => elems * esz >= w.small_message_threshold,
            Algorithm::Ring => true,
            Algorithm::RecursiveDoubling => false,
        };
        let seg_elems = (w.segment_bytes / esz).max(1);
        if ring {
            self.ring_phases(groups, elems, esz, w, fresh, 2)
        } else {
            // recursive_doubling.rs: fold, log2 p butterfly exchanges, unfold; whole buffer each.
            let p = 1usize << n.ilog2();
            let rem = n - p;
            let nseg = elems.div_ceil(seg_elems).max(1);
            let seg = (elems.div_ceil(nseg) * esz) as f64;
            let mut rounds: Vec<Vec<(usize, usize, f64)>> = Vec::new();
            if rem > 0 {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..rem).map(move |i| (g[2 * i], g[2 * i + 1], seg)))
                        .collect(),
                );
            }
            let old = |new: usize| if new < rem { 2 * new + 1 } else { new + rem };
            let mut mask = 1;
            while mask < p {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..p).map(move |r| (g[old(r)], g[old(r ^ mask)], seg)))
                        .collect(),
                );
                mask <<= 1;
            }
            if rem > 0 {
                rounds.push(
                    groups
                        .iter()
                        .flat_map(|g| (0..rem).map(move |i| (g[2 * i + 1], g[2 * i], seg)))
                        .collect(),
                );
            }
            let seconds = rounds
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let first = self.round_seconds(r, fresh && i == 0);
                    first + (nseg - 1) as f64 * self.round_seconds(r, false)
                })
                .sum();
            let total = (2 * rem + p * p.ilog2() as usize) as f64 * (elems * esz) as f64;
            Cost {
                seconds,
                bytes_per_rank: total / n as f64,
            }
        }
    }

    /// `phases` ring phases (ring.rs; 1: a reduce-scatter or an all-gather, 2: an all-reduce) of
    /// `elems` elements of `esz` bytes in every group at once: `phases·(n−1)` steps, every chunk
    /// cut into as many segments as the largest.
    fn ring_phases(
        &self,
        groups: &[Vec<usize>],
        elems: usize,
        esz: usize,
        w: &Workload,
        fresh: bool,
        phases: usize,
    ) -> Cost {
        let n = groups.first().map_or(1, Vec::len);
        if n <= 1 || elems == 0 {
            return Cost::default();
        }
        let (flows, nseg) = ring_round(groups, elems, esz, esz, w);
        Cost {
            seconds: self.round_seconds(&flows, fresh)
                + (phases * (n - 1) * nseg - 1) as f64 * self.round_seconds(&flows, false),
            bytes_per_rank: phases as f64 * (n - 1) as f64 / n as f64 * (elems * esz) as f64,
        }
    }

    /// The exact sum of `elems` values after their exponents are agreed, as
    /// `lockstep_comm::exact` runs it: where `scatter_pays` (the `i64` all-reduce would be a
    /// ring), a ring reduce-scatter of the `i64` sums and a ring all-gather of the `f32` results;
    /// otherwise one all-reduce of the `i64` sums. `narrow_first`: the whole-vector sum with no
    /// rank holding more than one micro-batch, whose reduce-scatter sends `f32` values in its
    /// first step (`ExactReducer::reduce_scattered_then_gathered`).
    fn exact_sum(
        &self,
        groups: &[Vec<usize>],
        elems: usize,
        w: &Workload,
        fresh: bool,
        narrow_first: bool,
    ) -> Cost {
        let scatter = match w.algorithm() {
            Algorithm::Auto => elems * 8 >= w.small_message_threshold,
            Algorithm::Ring => true,
            Algorithm::RecursiveDoubling => false,
        };
        if !scatter {
            return self.all_reduce(groups, elems, 8, w, fresh);
        }
        let gather = self.ring_phases(groups, elems, 4, w, false, 1);
        if !narrow_first {
            return self.ring_phases(groups, elems, 8, w, fresh, 1) + gather;
        }
        // Step 0 moves 4-byte values, steps 1..n−1 8-byte partial sums, in the segments of
        // an i64 ring (the ring cuts chunks by its element type).
        let n = groups.first().map_or(1, Vec::len);
        if n <= 1 || elems == 0 {
            return Cost::default();
        }
        let step = |esz: usize, fresh: bool| {
            let (flows, nseg) = ring_round(groups, elems, 8, esz, w);
            self.round_seconds(&flows, fresh)
                + (nseg - 1) as f64 * self.round_seconds(&flows, false)
        };
        let seconds = step(4, fresh) + (n - 2) as f64 * step(8, false);
        let chunk = elems as f64 / n as f64;
        Cost {
            seconds,
            bytes_per_rank: chunk * (4.0 + 8.0 * (n - 2) as f64),
        } + gather
    }

    /// The loss exchange of every step (`GradSync::exchange_loss`): an exact one-value sum, i.e.
    /// an all-reduce of two i32 (the exponent and the most micro-batches a rank holds) and one of
    /// one i64.
    pub(super) fn loss_exchange(&self, world: usize, w: &Workload) -> Cost {
        let g = [(0..world).collect::<Vec<_>>()];
        self.all_reduce(&g, 2, 4, w, false) + self.all_reduce(&g, 1, 8, w, false)
    }

    /// The gradient sum of a `stage`'s values within each group (`GradSync::sync` or, with
    /// overlap, one bucket at a time; overlap is assumed to hide nothing). Its first large
    /// message is the step's first: the links were idle during compute.
    pub(super) fn gradient_sync(
        &self,
        groups: &[Vec<usize>],
        stage: StageSize,
        w: &Workload,
    ) -> Cost {
        let (be, params) = (w.bucket_elems, stage.params);
        if w.reproducible && !w.overlap {
            let n = groups.first().map_or(1, Vec::len);
            // One shared exponent per bucket, and the most micro-batches a rank holds.
            let exponents = self.all_reduce(groups, stage.buckets + 1, 4, w, false);
            if self.shared_windows(groups, w) {
                return exponents + self.shared_sum(groups, params, w);
            }
            // Every rank of a data-parallel group holds ⌈microbatches / n⌉ micro-batches.
            let narrow_first = w.microbatches <= n;
            return exponents + self.exact_sum(groups, params, w, true, narrow_first);
        }
        let bucket = |len: usize, fresh: bool| -> Cost {
            if w.reproducible {
                self.all_reduce(groups, 1, 4, w, false)
                    + self.exact_sum(groups, len, w, fresh, false)
            } else {
                self.all_reduce(groups, len, 4, w, fresh)
            }
        };
        let (full, last) = (params / be, params % be);
        let mut c = Cost::default();
        if full > 0 {
            c = bucket(be, true);
            let rest = bucket(be, false);
            c.seconds += rest.seconds * (full - 1) as f64;
            c.bytes_per_rank += rest.bytes_per_rank * (full - 1) as f64;
        }
        if last > 0 {
            c = c + bucket(last, full == 0);
        }
        c
    }

    /// Whether the exact sum of `groups` reads shared-memory windows (`GradParts` in the
    /// trainer): a whole-vector exact sum (ZeRO below 2) over data-parallel groups of several
    /// ranks, all on one node, with a transport that shares memory.
    fn shared_windows(&self, groups: &[Vec<usize>], w: &Workload) -> bool {
        w.shared_memory
            && w.reproducible
            && w.zero < 2
            && self.nodes_used == 1
            && groups[0].len() > 1
    }

    /// `ExactReducer::reduce_shared` after the exponents: a dissemination barrier (⌈log2 n⌉
    /// rounds of a 1-byte token), and reads from the peers' windows at the shared-memory link's
    /// bandwidth: this rank's chunk of every part the others hold, then their chunks of the sum.
    /// Only the barrier's tokens are sent.
    fn shared_sum(&self, groups: &[Vec<usize>], params: usize, w: &Workload) -> Cost {
        let n = groups[0].len();
        let mut barrier = Cost::default();
        let mut dist = 1;
        while dist < n {
            let flows: Vec<(usize, usize, f64)> = groups[0]
                .iter()
                .enumerate()
                .map(|(i, &r)| (r, groups[0][(i + dist) % n], 1.0))
                .collect();
            barrier.seconds += self.round_seconds(&flows, false);
            barrier.bytes_per_rank += 1.0;
            dist <<= 1;
        }
        let others_parts = w.microbatches - w.microbatches.div_ceil(n).min(w.microbatches);
        let chunk = params as f64 / n as f64;
        let read_bytes = 4.0 * chunk * (others_parts as f64 + (n - 1) as f64);
        Cost {
            seconds: barrier.seconds + read_bytes / self.cluster.shm.bytes_per_s,
            bytes_per_rank: barrier.bytes_per_rank,
        }
    }

    /// Tensor parallelism's exact piece sums (`GroupPieceSum`: one bucket, so an all-reduce of two
    /// i32 — the exponent and the most parts a rank holds — and one of `elems` i64 values) of `count` tensors, within every tensor-parallel
    /// group of `layout` at once (neighbouring ranks).
    pub(super) fn piece_sums(
        &self,
        layout: Layout,
        elems: usize,
        count: usize,
        w: &Workload,
    ) -> Cost {
        let groups: Vec<Vec<usize>> = (0..layout.dp * layout.pp)
            .map(|g| (g * layout.tp..(g + 1) * layout.tp).collect())
            .collect();
        let one =
            self.all_reduce(&groups, 2, 4, w, false) + self.all_reduce(&groups, elems, 8, w, false);
        Cost {
            seconds: one.seconds * count as f64,
            bytes_per_rank: one.bytes_per_rank * count as f64,
        }
    }

    /// Pipeline point-to-point for one micro-batch over every stage boundary of every replica at
    /// once (`bytes[s]` crosses boundary `s → s+1`, forward as activations, back as gradients),
    /// each message in segments. Returns `(busiest, first)`: the longest one-way transfer per
    /// micro-batch once the pipeline is streaming (a link direction is a pipeline resource like a
    /// stage), and the first micro-batch's transfers along its path forward and back, found with
    /// the buckets full.
    pub(super) fn pipeline_p2p(&self, layout: Layout, bytes: &[f64], w: &Workload) -> (f64, f64) {
        let mut busiest = 0.0f64;
        let mut first = 0.0f64;
        for forward in [true, false] {
            let mut flows = Vec::new();
            let mut nsegs = Vec::new();
            // Each tp rank of a stage sends to the same tp rank of the next.
            let (pp, tp) = (layout.pp, layout.tp);
            for (r, t) in (0..layout.dp).flat_map(|r| (0..tp).map(move |t| (r, t))) {
                for (s, &b) in bytes.iter().enumerate() {
                    let (a, c) = ((r * pp + s) * tp + t, (r * pp + s + 1) * tp + t);
                    let nseg = (b as usize).div_ceil(w.segment_bytes).max(1) as f64;
                    flows.push(if forward {
                        (a, c, b / nseg)
                    } else {
                        (c, a, b / nseg)
                    });
                    nsegs.push(nseg);
                }
            }
            let busy = self.flow_seconds(&flows, false);
            let fresh = self.flow_seconds(&flows, true);
            // Per boundary, the slowest replica's; the path crosses every boundary once.
            let mut path = vec![0.0f64; bytes.len()];
            for (i, n) in nsegs.iter().enumerate() {
                busiest = busiest.max(n * busy[i]);
                let one = fresh[i] + (n - 1.0) * busy[i];
                let s = i % bytes.len().max(1);
                path[s] = path[s].max(one);
            }
            first += path.iter().sum::<f64>();
        }
        (busiest, first)
    }
}

/// One round of a ring step over every group at once — each rank sends one segment to its right
/// neighbour — and the number of such rounds per step: `elems` values cut into chunks and
/// segments as a ring of `cut_esz`-byte elements cuts them (`segment_bytes` per segment),
/// `wire_esz` bytes per value on the wire.
fn ring_round(
    groups: &[Vec<usize>],
    elems: usize,
    cut_esz: usize,
    wire_esz: usize,
    w: &Workload,
) -> (Vec<(usize, usize, f64)>, usize) {
    let n = groups.first().map_or(1, Vec::len);
    let seg_elems = (w.segment_bytes / cut_esz).max(1);
    let chunk0 = elems.div_ceil(n);
    let nseg = chunk0.div_ceil(seg_elems).max(1);
    let seg = (chunk0.div_ceil(nseg) * wire_esz) as f64;
    let flows = groups
        .iter()
        .flat_map(|g| (0..n).map(move |i| (g[i], g[(i + 1) % n], seg)))
        .collect();
    (flows, nseg)
}

/// Gradient passes on the CPU outside the wire (`U`): reproducible mode converts each local
/// micro-batch gradient to fixed point (exponent scan + accumulate) and the sum back; plain mode
/// adds the local gradients. The ring's own adds are part of a link's measured bandwidth.
pub(super) fn sync_units(params: usize, local_microbatches: usize, reproducible: bool) -> f64 {
    let passes = if reproducible {
        local_microbatches + 1
    } else {
        local_microbatches.max(1)
    };
    (params * passes) as f64
}

/// Bytes crossing each stage boundary per micro-batch (the last layer of each stage but the last).
pub(super) fn boundary_bytes(w: &Workload, stages: &[(usize, usize)]) -> Vec<f64> {
    stages[..stages.len().saturating_sub(1)]
        .iter()
        .map(|&(_, end)| (w.layers[end - 1].activation_bytes_per_sample * w.microbatch) as f64)
        .collect()
}

/// Mean point-to-point bytes a rank sends per step: every boundary carries one activation forward
/// and one gradient back per micro-batch, `2·m·Σ boundary / pp` per rank.
pub(super) fn p2p_bytes_per_rank(layout: Layout, boundary: &[f64], m: usize) -> f64 {
    2.0 * m as f64 * boundary.iter().sum::<f64>() / layout.pp as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::{close, whole, workload};

    const MIB: usize = 1 << 20;

    /// `world` ranks on one node whose links are all `link`.
    fn one_node(world: usize, link: Link) -> Cluster {
        Cluster::uniform(world, link)
    }

    #[test]
    fn after_idle_time_a_full_bucket_sends_its_burst_at_once() {
        let l = Link {
            burst_bytes: 4e5,
            ..Link::new(1e-3, 1e6)
        };
        // Busy: only α·β = 1000 bytes refilled; fresh: the whole 400 kB bucket.
        assert!(close(l.message_seconds(5e5, 1.0), 1e-3 + (5e5 - 1e3) / 1e6));
        assert!(close(l.first_message_seconds(5e5, 1.0), 1e-3 + 0.1));
        assert!(close(
            l.first_message_seconds(5e5, 2.0),
            1e-3 + (5e5 - 2e5) * 2.0 / 1e6
        ));
        assert!(close(l.first_message_seconds(3e5, 1.0), 1e-3));
        // A ring's first round gets it: 2(n−1) rounds, one of them fresh.
        let c = one_node(2, l);
        let place = Placement::new(&c, 2);
        let g = vec![vec![0, 1]];
        let elems = 2 * 100_000; // chunks of 400 kB f32: one segment each
        let fresh = place.all_reduce(&g, elems, 4, &workload(1), true).seconds;
        let busy = place.all_reduce(&g, elems, 4, &workload(1), false).seconds;
        assert!(close(busy, 2.0 * (1e-3 + (4e5 - 1e3) / 1e6)), "{busy}");
        assert!(close(fresh, 1e-3 + (1e-3 + (4e5 - 1e3) / 1e6)), "{fresh}");
    }

    #[test]
    fn ring_all_reduce_matches_its_closed_form() {
        let (a, b) = (20e-6, 2e9);
        let w = workload(1);
        for n in [2usize, 3, 4, 8] {
            let c = one_node(n, Link::new(a, b));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            // 8 MiB of f32 divisible by n·segments: chunk S/n in g = ⌈(S/n)/512 KiB⌉ segments.
            let elems = 2 * MIB * 3 * 5 * 7;
            let s = (elems * 4) as f64;
            let chunk = s / n as f64;
            let nseg = (chunk / (512.0 * 1024.0)).ceil();
            let expect = 2.0 * (n - 1) as f64 * nseg * (a + chunk / nseg / b);
            let got = place.all_reduce(&g, elems, 4, &w, false);
            assert!(
                close(got.seconds, expect),
                "n={n}: {} vs {expect}",
                got.seconds
            );
            assert!(close(
                got.bytes_per_rank,
                2.0 * (n - 1) as f64 / n as f64 * s
            ));
        }
    }

    #[test]
    fn recursive_doubling_matches_its_closed_form() {
        let (a, b) = (20e-6, 2e9);
        let w = workload(1);
        let s = 64.0 * 1024.0; // below the 256 KiB threshold: one segment
        for (n, rounds, sent) in [
            (2usize, 1.0, 1.0),
            (4, 2.0, 2.0),
            (8, 3.0, 3.0),
            (3, 3.0, 4.0 / 3.0),
            (6, 4.0, 2.0),
        ] {
            let c = one_node(n, Link::new(a, b));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            let got = place.all_reduce(&g, 16 * 1024, 4, &w, false);
            // log2 p rounds, plus fold and unfold when n is not a power of two.
            assert!(
                close(got.seconds, rounds * (a + s / b)),
                "n={n}: {}",
                got.seconds
            );
            // (2·rem + p·log2 p)·S / n bytes per rank.
            assert!(
                close(got.bytes_per_rank, sent * s),
                "n={n}: {}",
                got.bytes_per_rank
            );
        }
    }

    #[test]
    fn the_algorithm_is_chosen_by_size_like_the_communicator() {
        let c = one_node(4, Link::new(1e-3, 1e12));
        let place = Placement::new(&c, 4);
        let g = vec![(0..4).collect::<Vec<_>>()];
        let w = workload(1);
        // Just under 256 KiB: recursive doubling, 2 rounds of one message.
        let rd = place.all_reduce(&g, 64 * 1024 - 1, 4, &w, false);
        assert!((rd.seconds - 2e-3).abs() < 1e-6, "{}", rd.seconds);
        // At 256 KiB: ring, 2(n−1) = 6 rounds.
        let ring = place.all_reduce(&g, 64 * 1024, 4, &w, false);
        assert!((ring.seconds - 6e-3).abs() < 1e-6, "{}", ring.seconds);
        let forced = Workload {
            algorithm: lockstep_comm::Algorithm::Ring,
            ..workload(1)
        };
        assert!((place.all_reduce(&g, 10, 4, &forced, false).seconds - 6e-3).abs() < 1e-6);
    }

    #[test]
    fn bytes_per_step_equal_what_the_bench_mlp_runs_sent() {
        // MLP 784-512-512-10 (669,706 parameters), reproducible, 4 micro-batches: measured on 2
        // and 4 workers (runs of configs/bench-mlp784.toml, the i64 sums reduce-scattered and the
        // f32 sums all-gathered; on 4 workers, one micro-batch each, the reduce-scatter's first
        // step sends f32 values): 4,018,300 and 5,357,772 bytes by rank 0 per step. The model
        // counts the mean over ranks; chunks differ by one value, so a rank may send a few
        // bytes more or less than the mean.
        let w = workload(669_706);
        for (n, measured) in [(2usize, 4_018_300.0), (4, 5_357_772.0)] {
            let c = one_node(n, Link::new(1e-5, 1e9));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            let b = (place.loss_exchange(n, &w) + place.gradient_sync(&g, whole(&w), &w))
                .bytes_per_rank;
            assert!((b - measured).abs() <= 8.0, "n={n}: {b} vs {measured}");
        }
    }

    #[test]
    fn one_node_data_parallel_groups_send_only_small_messages_through_shared_windows() {
        // The same MLP and runs through shared windows (crates/cli/tests/plan.rs compares a run's
        // bytes): loss exchange (2 i32 + 1 i64) and exponents (11 buckets + 1 i32) by recursive
        // doubling, plus the barrier's ⌈log2 n⌉ 1-byte tokens; no gradient bytes.
        let w = Workload {
            shared_memory: true,
            ..workload(669_706)
        };
        let (a, b) = (1e-5, 1e9);
        for (n, rounds) in [(2usize, 1.0), (4, 2.0)] {
            let c = one_node(n, Link::new(a, b));
            let place = Placement::new(&c, n);
            let g = vec![(0..n).collect::<Vec<_>>()];
            let sync = place.gradient_sync(&g, whole(&w), &w);
            let small = place.all_reduce(&g, w.params.div_ceil(w.bucket_elems) + 1, 4, &w, false);
            assert!(
                close(sync.bytes_per_rank, small.bytes_per_rank + rounds),
                "n={n}"
            );
            // Reads: this rank's chunk of the 4 − ⌈4/n⌉ parts others hold, and n − 1 chunks.
            let chunk = w.params as f64 / n as f64;
            let reads = 4.0 * chunk * ((4 - 4usize.div_ceil(n)) as f64 + (n - 1) as f64) / b;
            let barrier = rounds * (a + 1.0 / b);
            assert!(
                close(sync.seconds, small.seconds + barrier + reads),
                "n={n}"
            );
        }
        // Two nodes, ZeRO 2 or overlap: the rings as before.
        let c = Cluster {
            nodes: 2,
            workers_per_node: 1,
            ..one_node(2, Link::new(a, b))
        };
        let g = vec![vec![0, 1]];
        let rings = Placement::new(&one_node(2, Link::new(a, b)), 2).gradient_sync(
            &g,
            whole(&w),
            &workload(669_706),
        );
        for (cluster, w) in [
            (&c, w.clone()),
            (
                &one_node(2, Link::new(a, b)),
                Workload {
                    zero: 2,
                    ..w.clone()
                },
            ),
            (
                &one_node(2, Link::new(a, b)),
                Workload {
                    overlap: true,
                    ..w.clone()
                },
            ),
        ] {
            let got = Placement::new(cluster, 2).gradient_sync(&g, whole(&w), &w);
            assert!(got.bytes_per_rank >= rings.bytes_per_rank * 0.99, "{w:?}");
        }
    }

    #[test]
    fn flows_across_nodes_share_the_link() {
        // 2 nodes × 2 workers: recursive doubling pairs (0,1),(2,3) inside nodes, then (0,2),(1,3)
        // across: two flows each way share the inter-node link.
        let c = Cluster {
            nodes: 2,
            workers_per_node: 2,
            inter: Link::new(100e-6, 1e8),
            intra: Link::new(10e-6, 1e10),
            shm: Link::new(1e-6, 1e11),
            compute_scale: 1.0,
        };
        let place = Placement::new(&c, 4);
        assert_eq!(place.transport(), "tcp");
        let g = vec![vec![0, 1, 2, 3]];
        let s = 100_000.0;
        let got = place.all_reduce(&g, 25_000, 4, &workload(1), false).seconds;
        let expect = (10e-6 + s / 1e10) + (100e-6 + 2.0 * s / 1e8);
        assert!(close(got, expect), "{got} vs {expect}");
        // A ring over the same ranks: links 1→2 and 3→0 cross, one flow each way.
        let elems = 4 * MIB;
        let ring = place.all_reduce(&g, elems, 4, &workload(1), false).seconds;
        let seg = 512.0 * 1024.0;
        assert!(close(ring, 6.0 * 8.0 * (100e-6 + seg / 1e8)), "{ring}");
    }
}
