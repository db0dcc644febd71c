//! The run's metrics as a TensorBoard event file (`<run>/tensorboard/`), so that
//! `tensorboard --logdir runs/` shows every run's loss, learning rate, throughput, gradient norm,
//! evaluation and per-rank phases next to each other.
//!
//! The file is derived from metrics.jsonl's records alone (rank 0 rewrites it whenever it
//! rewrites metrics.jsonl), so the two always tell the same story, restarts included. Format:
//! TensorFlow's record framing (`u64` length, masked CRC-32C of it, the bytes, masked CRC-32C of
//! them) around `Event` protocol buffers — the first one `file_version = "brain.Event:2"`, then
//! one per step whose `summary` holds `simple_value` scalars. Only the few protobuf fields used
//! are encoded (wire types 1, 0, 2 and 5), by hand: no TensorFlow or protobuf dependency.

use std::collections::BTreeMap;

use crate::metrics::StepRecord;

/// The event file's name inside `<run>/tensorboard/` ("tfevents" is what TensorBoard looks for).
pub const EVENT_FILE: &str = "events.out.tfevents.0.lockstep";

/// The event file of `records` (metrics.jsonl's, any order; one per rank and step), wall times
/// counted from `start_unix` (seconds since the epoch) by the steps' durations.
pub fn event_file(records: &[StepRecord], start_unix: f64) -> Vec<u8> {
    let mut by_step: BTreeMap<u64, Vec<&StepRecord>> = BTreeMap::new();
    for r in records {
        by_step.entry(r.step).or_default().push(r);
    }
    let mut out = Vec::new();
    let mut first = Vec::new();
    field_f64(&mut first, 1, start_unix);
    field_bytes(&mut first, 3, b"brain.Event:2");
    frame(&mut out, &first);
    let mut wall = start_unix;
    for (step, mut ranks) in by_step {
        ranks.sort_by_key(|r| r.rank);
        wall += ranks.iter().map(|r| r.step_seconds).fold(0.0, f64::max);
        let mut event = Vec::new();
        field_f64(&mut event, 1, wall);
        field_varint(&mut event, 2, step);
        field_bytes(&mut event, 5, &summary(&scalars(&ranks)));
        frame(&mut out, &event);
    }
    out
}

/// The scalars of one step: the job-wide figures from rank 0's record (the same on every rank),
/// each rank's phases.
fn scalars(ranks: &[&StepRecord]) -> Vec<(String, f64)> {
    let r0 = ranks[0];
    let mut v = vec![
        ("train/loss".to_string(), r0.loss),
        ("train/lr".to_string(), f64::from(r0.lr)),
        ("train/samples_per_sec".to_string(), r0.samples_per_sec),
    ];
    if let Some(norm) = r0.grad_norm {
        v.push(("train/grad_norm".into(), norm));
    }
    // The job's names never take lockstep's own (refused when the job is validated).
    v.extend(
        r0.train_metrics
            .iter()
            .map(|(k, x)| (format!("train/{k}"), *x)),
    );
    if let Some(e) = ranks.iter().find_map(|r| r.eval.as_ref()) {
        v.push(("eval/test_loss".into(), e.test_loss));
        v.push(("eval/test_accuracy".into(), e.test_accuracy));
        v.extend(e.metrics.iter().map(|(k, x)| (format!("eval/{k}"), *x)));
    }
    for r in ranks {
        let s = &r.seconds;
        for (phase, x) in [
            ("step", r.step_seconds),
            ("data", s.data),
            ("forward", s.forward),
            ("backward", s.backward),
            ("device_copy", s.device_copy),
            ("communication", s.communication),
            ("waiting", s.waiting),
            ("optimizer", s.optimizer),
            ("checkpoint", s.checkpoint),
        ] {
            v.push((format!("seconds/rank{}/{phase}", r.rank), x));
        }
    }
    v.retain(|(_, x)| x.is_finite());
    v
}

/// A `Summary` message: one `Value { tag, simple_value }` per scalar.
fn summary(scalars: &[(String, f64)]) -> Vec<u8> {
    let mut s = Vec::new();
    for (tag, x) in scalars {
        let mut value = Vec::new();
        field_bytes(&mut value, 1, tag.as_bytes());
        field_f32(&mut value, 2, *x as f32);
        field_bytes(&mut s, 1, &value);
    }
    s
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u64, v: u64) {
    varint(out, field << 3);
    varint(out, v);
}

fn field_f64(out: &mut Vec<u8>, field: u64, v: f64) {
    varint(out, field << 3 | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn field_f32(out: &mut Vec<u8>, field: u64, v: f32) {
    varint(out, field << 3 | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn field_bytes(out: &mut Vec<u8>, field: u64, v: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, v.len() as u64);
    out.extend_from_slice(v);
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
fn frame(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82f6_3b78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| {
        TABLE[((c ^ u32::from(b)) & 0xff) as usize] ^ (c >> 8)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_of_the_standard_check_string() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_frame_and_steps_come_in_order() {
        let rec = |rank, step, loss| StepRecord {
            rank,
            step,
            loss,
            lr: 0.5,
            samples: 8,
            samples_per_sec: 100.0,
            step_seconds: 0.25,
            seconds: Default::default(),
            bytes_sent: 0,
            eval: None,
            pipeline: None,
            rss_bytes: None,
            grad_norm: None,
            train_metrics: Default::default(),
        };
        let file = event_file(&[rec(1, 1, 2.0), rec(0, 1, 2.0), rec(0, 0, 3.0)], 1000.0);
        // Walk the frames: three events (version, step 0, step 1), each CRC valid.
        let mut at = 0;
        let mut frames = 0;
        while at < file.len() {
            let len = u64::from_le_bytes(file[at..at + 8].try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(file[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(&file[at..at + 8]));
            let data = &file[at + 12..at + 12 + len];
            let dcrc = u32::from_le_bytes(file[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(dcrc, masked_crc(data));
            at += 16 + len;
            frames += 1;
        }
        assert_eq!(frames, 3);
        let text = String::from_utf8_lossy(&file);
        assert!(text.contains("brain.Event:2") && text.contains("train/loss"));
        assert!(text.contains("seconds/rank1/forward"));
    }
}
