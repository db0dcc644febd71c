//! The cluster the model predicts for: classes of link (latency, bandwidth, token bucket),
//! identical nodes, and the user's description of them (flags and/or a TOML file), checked and
//! filled with the defaults; plus the links of the run a plan is calibrated from.

use serde::{Deserialize, Serialize};

use super::{
    PlanError, DEFAULT_INTRA_GBYTES_PER_S, DEFAULT_INTRA_LATENCY_US, DEFAULT_LINK_EFFICIENCY,
    DEFAULT_LINK_LATENCY_US, DEFAULT_SHM_GBYTES_PER_S, DEFAULT_SHM_LATENCY_US,
};

/// `--link-gbps / link_gbps`: how a cluster key is spelled as a flag and in the TOML file.
fn key_name(key: &str) -> String {
    format!("--{} (`{key}` in a cluster file)", key.replace('_', "-"))
}

fn cluster_error(key: &str, message: impl Into<String>) -> PlanError {
    PlanError::Cluster {
        key: key_name(key),
        message: message.into(),
    }
}

/// One class of link: latency α, payload bandwidth β and, for a shaped link, its token bucket.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Link {
    /// One-way latency of one message (seconds).
    pub latency_s: f64,
    /// Payload bytes per second for one flow alone on the link.
    pub bytes_per_s: f64,
    /// Token-bucket capacity of a shaped link (bytes); 0 for a plain line-rate link.
    pub burst_bytes: f64,
}

impl Link {
    pub fn new(latency_s: f64, bytes_per_s: f64) -> Self {
        Self {
            latency_s,
            bytes_per_s,
            burst_bytes: 0.0,
        }
    }

    /// Seconds to deliver one message of `bytes` while `share` flows split the link, in a busy
    /// stretch (the bucket refilled only while the message waited out its latency):
    /// `α + max(0, s − min(b, αβ)/k)·k/β`. Empty messages are never sent (0 s).
    pub fn message_seconds(&self, bytes: f64, share: f64) -> f64 {
        let refill = self.burst_bytes.min(self.latency_s * self.bytes_per_s);
        self.send_seconds(bytes, share, refill)
    }

    /// The same for the first message after the link was idle (e.g. during compute), when the
    /// bucket is full: `α + max(0, s − b/k)·k/β`.
    pub fn first_message_seconds(&self, bytes: f64, share: f64) -> f64 {
        self.send_seconds(bytes, share, self.burst_bytes)
    }

    fn send_seconds(&self, bytes: f64, share: f64, tokens: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let k = share.max(1.0);
        self.latency_s + (bytes - tokens / k).max(0.0) * k / self.bytes_per_s
    }
}

/// A cluster of identical nodes, as the model sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Cluster {
    pub nodes: usize,
    pub workers_per_node: usize,
    /// Between nodes: each node's connection to the others (full duplex).
    pub inter: Link,
    /// Between workers of one node when the job spans nodes (TCP over loopback).
    pub intra: Link,
    /// Between workers when the whole job is on one node (shared memory).
    pub shm: Link,
    /// Per-worker compute speed relative to the calibration run (2 = twice as fast).
    pub compute_scale: f64,
}

impl Cluster {
    pub fn capacity(&self) -> usize {
        self.nodes * self.workers_per_node
    }

    /// One node holding `world` workers whose every link is `link` (how a calibration run's own
    /// links are described).
    pub fn uniform(world: usize, link: Link) -> Self {
        Self {
            nodes: 1,
            workers_per_node: world.max(1),
            inter: link,
            intra: link,
            shm: link,
            compute_scale: 1.0,
        }
    }
}

/// A cluster as a user describes it (TOML file and/or flags): human units, every field optional
/// until [`ClusterSpec::resolve`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub nodes: Option<usize>,
    pub workers_per_node: Option<usize>,
    /// Line rate between nodes, Gbit/s.
    pub link_gbps: Option<f64>,
    /// One-way latency between nodes, µs.
    pub link_latency_us: Option<f64>,
    /// Token-bucket burst of a shaped inter-node link, KiB (0 = not shaped).
    pub link_burst_kib: Option<f64>,
    /// Payload fraction of the line rate (headers, ACKs).
    pub link_efficiency: Option<f64>,
    /// TCP between workers of one node in a multi-node job: payload GB/s and µs.
    pub intra_gbytes_per_s: Option<f64>,
    pub intra_latency_us: Option<f64>,
    /// Shared memory in a one-node job: bus bandwidth GB/s and µs.
    pub shm_gbytes_per_s: Option<f64>,
    pub shm_latency_us: Option<f64>,
    /// Per-worker compute speed relative to the calibration run.
    pub compute_scale: Option<f64>,
}

impl ClusterSpec {
    /// Parse a cluster file; unknown keys and wrong types are errors naming `origin`.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, PlanError> {
        toml::from_str(text).map_err(|e: toml::de::Error| PlanError::Cluster {
            key: origin.to_string(),
            message: e.to_string().trim().to_string(),
        })
    }

    /// Field by field, `self` where set, else `base` (flags over a file).
    pub fn or(self, base: ClusterSpec) -> ClusterSpec {
        ClusterSpec {
            nodes: self.nodes.or(base.nodes),
            workers_per_node: self.workers_per_node.or(base.workers_per_node),
            link_gbps: self.link_gbps.or(base.link_gbps),
            link_latency_us: self.link_latency_us.or(base.link_latency_us),
            link_burst_kib: self.link_burst_kib.or(base.link_burst_kib),
            link_efficiency: self.link_efficiency.or(base.link_efficiency),
            intra_gbytes_per_s: self.intra_gbytes_per_s.or(base.intra_gbytes_per_s),
            intra_latency_us: self.intra_latency_us.or(base.intra_latency_us),
            shm_gbytes_per_s: self.shm_gbytes_per_s.or(base.shm_gbytes_per_s),
            shm_latency_us: self.shm_latency_us.or(base.shm_latency_us),
            compute_scale: self.compute_scale.or(base.compute_scale),
        }
    }

    /// Check every value and fill the defaults. Errors name the flag and the file key.
    pub fn resolve(&self) -> Result<Cluster, PlanError> {
        let count = |key: &str, v: Option<usize>, default: Option<usize>| match v.or(default) {
            None => Err(cluster_error(key, "is required")),
            Some(0) => Err(cluster_error(key, "must be at least 1")),
            Some(n) => Ok(n),
        };
        let nodes = count("nodes", self.nodes, Some(1))?;
        let workers_per_node = count("workers_per_node", self.workers_per_node, None)?;
        let positive = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(cluster_error(
                    key,
                    format!("must be a positive number, got {v}"),
                ))
            }
        };
        let non_negative = |key: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(cluster_error(key, format!("must be ≥ 0, got {v}")))
            }
        };
        let link_gbps = match self.link_gbps {
            Some(v) => positive("link_gbps", v)?,
            None if nodes > 1 => {
                return Err(cluster_error(
                    "link_gbps",
                    format!("is required for {nodes} nodes: the line rate between nodes in Gbit/s"),
                ))
            }
            None => 1.0, // unused: one node never crosses the inter-node link
        };
        let efficiency = self.link_efficiency.unwrap_or(DEFAULT_LINK_EFFICIENCY);
        if !(efficiency.is_finite() && efficiency > 0.0 && efficiency <= 1.0) {
            return Err(cluster_error(
                "link_efficiency",
                format!("must be in (0, 1], got {efficiency}"),
            ));
        }
        let us = |key: &str, v: Option<f64>, default: f64| {
            non_negative(key, v.unwrap_or(default)).map(|v| v * 1e-6)
        };
        let gbytes = |key: &str, v: Option<f64>, default: f64| {
            positive(key, v.unwrap_or(default)).map(|v| v * 1e9)
        };
        let inter = Link {
            latency_s: us(
                "link_latency_us",
                self.link_latency_us,
                DEFAULT_LINK_LATENCY_US,
            )?,
            bytes_per_s: link_gbps * 1e9 / 8.0 * efficiency,
            burst_bytes: non_negative("link_burst_kib", self.link_burst_kib.unwrap_or(0.0))?
                * 1024.0,
        };
        let intra = Link::new(
            us(
                "intra_latency_us",
                self.intra_latency_us,
                DEFAULT_INTRA_LATENCY_US,
            )?,
            gbytes(
                "intra_gbytes_per_s",
                self.intra_gbytes_per_s,
                DEFAULT_INTRA_GBYTES_PER_S,
            )?,
        );
        let shm = Link::new(
            us(
                "shm_latency_us",
                self.shm_latency_us,
                DEFAULT_SHM_LATENCY_US,
            )?,
            gbytes(
                "shm_gbytes_per_s",
                self.shm_gbytes_per_s,
                DEFAULT_SHM_GBYTES_PER_S,
            )?,
        );
        let compute_scale = positive("compute_scale", self.compute_scale.unwrap_or(1.0))?;
        Ok(Cluster {
            nodes,
            workers_per_node,
            inter,
            intra,
            shm,
            compute_scale,
        })
    }
}

/// The link a calibration run used, from its transport: this machine's shared memory or loopback
/// TCP defaults, unless the caller measured better (`gbytes_per_s`, `latency_us`).
pub fn calibration_link(
    transport: &str,
    gbytes_per_s: Option<f64>,
    latency_us: Option<f64>,
) -> Result<Link, PlanError> {
    let (g, l) = match transport {
        "shm" => (DEFAULT_SHM_GBYTES_PER_S, DEFAULT_SHM_LATENCY_US),
        _ => (DEFAULT_INTRA_GBYTES_PER_S, DEFAULT_INTRA_LATENCY_US),
    };
    let g = gbytes_per_s.unwrap_or(g);
    let l = latency_us.unwrap_or(l);
    let flag = |key: &str, message: String| PlanError::Cluster {
        key: key.to_string(),
        message,
    };
    if !(g.is_finite() && g > 0.0) {
        return Err(flag(
            "--calib-gbytes-per-s",
            format!("must be a positive number, got {g}"),
        ));
    }
    if !(l.is_finite() && l >= 0.0) {
        return Err(flag("--calib-latency-us", format!("must be ≥ 0, got {l}")));
    }
    Ok(Link::new(l * 1e-6, g * 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::test_support::close;

    #[test]
    fn a_message_costs_latency_plus_size_over_bandwidth_and_a_bucket_hides_latency() {
        let l = Link::new(1e-3, 1e6);
        assert!(close(l.message_seconds(5e5, 1.0), 1e-3 + 0.5));
        assert!(close(l.message_seconds(5e5, 2.0), 1e-3 + 1.0));
        assert_eq!(l.message_seconds(0.0, 1.0), 0.0);
        // A bucket refills α·β = 1000 bytes during the latency: a large message costs s/β.
        let shaped = Link {
            burst_bytes: 1e9,
            ..l
        };
        assert!(close(shaped.message_seconds(5e5, 1.0), 0.5));
        // ... and a small one its latency alone; a small bucket caps the refill.
        assert!(close(shaped.message_seconds(10.0, 1.0), 1e-3));
        let small = Link {
            burst_bytes: 400.0,
            ..l
        };
        assert!(close(
            small.message_seconds(5e5, 1.0),
            1e-3 + (5e5 - 400.0) / 1e6
        ));
    }

    #[test]
    fn bad_cluster_descriptions_name_the_flag() {
        let err = |s: ClusterSpec| s.resolve().unwrap_err().to_string();
        let base = ClusterSpec {
            nodes: Some(2),
            workers_per_node: Some(2),
            link_gbps: Some(1.0),
            ..Default::default()
        };
        let e = err(ClusterSpec {
            link_gbps: Some(0.0),
            ..base.clone()
        });
        assert!(
            e.contains("--link-gbps") && e.contains("link_gbps") && e.contains("positive"),
            "{e}"
        );
        let e = err(ClusterSpec {
            link_gbps: None,
            ..base.clone()
        });
        assert!(
            e.contains("--link-gbps") && e.contains("required for 2 nodes"),
            "{e}"
        );
        let e = err(ClusterSpec {
            workers_per_node: None,
            ..base.clone()
        });
        assert!(
            e.contains("--workers-per-node") && e.contains("required"),
            "{e}"
        );
        let e = err(ClusterSpec {
            nodes: Some(0),
            ..base.clone()
        });
        assert!(e.contains("--nodes") && e.contains("at least 1"), "{e}");
        let e = err(ClusterSpec {
            link_efficiency: Some(1.5),
            ..base.clone()
        });
        assert!(e.contains("--link-efficiency"), "{e}");
        let e = err(ClusterSpec {
            link_latency_us: Some(-1.0),
            ..base.clone()
        });
        assert!(e.contains("--link-latency-us"), "{e}");
        let e = err(ClusterSpec {
            compute_scale: Some(f64::NAN),
            ..base.clone()
        });
        assert!(e.contains("--compute-scale"), "{e}");
        let e = ClusterSpec::from_toml_str("nodes = 2\nlink_gbs = 1", "cluster.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cluster.toml") && e.contains("link_gbs"), "{e}");
        // Flags win over the file; the file fills the rest.
        let file =
            ClusterSpec::from_toml_str("nodes = 2\nworkers_per_node = 4\nlink_gbps = 10", "f")
                .unwrap();
        let c = ClusterSpec {
            nodes: Some(3),
            ..Default::default()
        }
        .or(file)
        .resolve()
        .unwrap();
        assert_eq!((c.nodes, c.workers_per_node), (3, 4));
        assert!(close(
            c.inter.bytes_per_s,
            10e9 / 8.0 * DEFAULT_LINK_EFFICIENCY
        ));
    }

    #[test]
    fn the_calibration_link_defaults_by_transport_and_checks_its_flags() {
        let shm = calibration_link("shm", None, None).unwrap();
        assert!(close(shm.bytes_per_s, DEFAULT_SHM_GBYTES_PER_S * 1e9));
        let tcp = calibration_link("tcp", Some(1.5), Some(20.0)).unwrap();
        assert!(close(tcp.bytes_per_s, 1.5e9) && close(tcp.latency_s, 20e-6));
        let e = calibration_link("tcp", Some(0.0), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--calib-gbytes-per-s"), "{e}");
    }
}
