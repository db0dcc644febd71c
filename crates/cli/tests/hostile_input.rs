//! Flags and values a careless user or an attacker might pass, each refused before anything is
//! written or spawned: exit status 3, a message naming the flag or path, no panic (exit 101), no
//! worker started, and no file replaced — the findings of the hostile test, reproduced with the
//! real binary.

use std::path::Path;
use std::process::Output;

mod common;
use common::lockstep;

fn run(args: &[&str]) -> Output {
    lockstep(args).output().expect("spawn lockstep")
}

/// Exit status 3 with every `want` in the error, no panic, no worker.
fn refused(args: &[&str], want: &[&str]) {
    let o = run(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(
        o.status.code(),
        Some(3),
        "{args:?}: expected exit status 3:\n{err}"
    );
    for w in want {
        assert!(
            err.contains(w),
            "{args:?}: the error does not name {w:?}:\n{err}"
        );
    }
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert!(!err.contains("[rank "), "{args:?} started a worker:\n{err}");
}

#[test]
fn timeouts_threads_and_faults_out_of_range_are_refused_before_the_run_directory_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r");
    let o = out.to_str().unwrap();
    for v in ["nan", "inf", "1e300", "-1", "0", "0.5"] {
        let stall = format!("--stall-timeout={v}");
        refused(&["train", "--out", o, &stall], &["--stall-timeout"]);
        let beat = format!("--heartbeat-timeout={v}");
        refused(&["train", "--out", o, &beat], &["--heartbeat-timeout"]);
    }
    refused(
        &["train", "--out", o, "--threads-per-worker", "100000"],
        &["--threads-per-worker 100000", "core"],
    );
    refused(
        &["train", "--out", o, "--threads-per-worker", "0"],
        &["--threads-per-worker 0"],
    );
    for gib in ["nan", "inf", "-1", "0", "1e300", "0.0001"] {
        let cap = format!("--worker-memory-gib={gib}");
        refused(
            &["train", "--out", o, &cap],
            &["--worker-memory-gib", "GiB"],
        );
    }
    for factor in ["1e308", "inf", "nan", "0.5"] {
        let spec = format!("slow:rank=1,factor={factor}");
        refused(&["train", "--out", o, "--inject", &spec], &["factor"]);
    }
    refused(&["train", "--out", o, "--nproc", "100000"], &["--nproc"]);
    refused(
        &[
            "train",
            "--out",
            o,
            "--nnodes",
            "4294967296",
            "--node-rank",
            "0",
        ],
        &["--nnodes"],
    );
    // A rendezvous backend lockstep does not have, and etcd endpoints that are not HOST:PORT.
    refused(
        &[
            "train",
            "--out",
            o,
            "--nnodes",
            "2",
            "--rdzv-backend",
            "consul",
        ],
        &["--rdzv-backend", "consul"],
    );
    refused(
        &[
            "train",
            "--out",
            o,
            "--nnodes",
            "2",
            "--rdzv-backend",
            "etcd",
            "--rdzv",
            "etcd://h1:2379,h2",
        ],
        &["--rdzv", "\"h2\"", "HOST:PORT"],
    );
    for (set, field) in [
        ("optimizer.eps=inf", "optimizer.eps"),
        ("optimizer.eps=nan", "optimizer.eps"),
        ("optimizer.weight_decay=inf", "optimizer.weight_decay"),
        ("dist.timeout_secs=1e-9", "dist.timeout_secs"),
        ("train.lr=1e38", "train.lr"),
    ] {
        refused(&["train", "--out", o, "--set", set], &[field]);
    }
    // Input files that never end or are not files are refused, not read forever.
    refused(
        &["train", "--out", o, "--config", "/dev/zero"],
        &["/dev/zero", "not a regular file"],
    );
    // A malformed command line is bad input too (not clap's exit status 2).
    refused(
        &["train", "--out", o, "--no-such-flag"],
        &["--no-such-flag"],
    );
    refused(
        &["train", "--out", o, "--max-restarts=-1"],
        &["--max-restarts"],
    );
    // The environment is input too: the transport's knobs (refused by the launcher, not by
    // every worker, whose failures it would restart), an engine's malformed variables, a
    // multi-node job's missing or malformed secret.
    let multi = [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--rdzv",
        "127.0.0.1:29999",
    ];
    for (vars, flags, want) in [
        (
            &[("LOCKSTEP_TEST_LATENCY_US", "abc")][..],
            &[][..],
            "LOCKSTEP_TEST_LATENCY_US=abc",
        ),
        (
            &[("LOCKSTEP_TCP_RECV_LOW_WATER", "-1")],
            &[],
            "LOCKSTEP_TCP_RECV_LOW_WATER=-1",
        ),
        (&[("RANK", "abc"), ("WORLD_SIZE", "2")], &[], "RANK=abc"),
        (
            &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "x")],
            &[],
            "SLURM_NTASKS=x",
        ),
        (
            &[("LOCKSTEP_SECRET", "")],
            &multi,
            "needs the same LOCKSTEP_SECRET",
        ),
        (&[("LOCKSTEP_SECRET", "xyz")], &multi, "LOCKSTEP_SECRET"),
    ] {
        let mut args = vec!["train", "--out", o, "--nproc", "1"];
        args.extend_from_slice(flags);
        let mut cmd = lockstep(&args);
        cmd.env_remove("LOCKSTEP_SECRET");
        for (k, v) in vars.iter().filter(|(_, v)| !v.is_empty()) {
            cmd.env(k, v);
        }
        let r = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(3), "{vars:?}:\n{err}");
        assert!(err.contains(want), "{vars:?}: {want:?} missing from\n{err}");
        assert!(!err.contains("[rank ") && !err.contains("restart"), "{err}");
    }
    assert!(!out.exists(), "a refused request created the run directory");
}

#[test]
fn plans_and_benchmarks_refuse_absurd_sizes_and_special_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    let run_dir = tmp.path().join("run");
    let o = run(&[
        "train",
        "--out",
        run_dir.to_str().unwrap(),
        "--set",
        "train.steps=12",
        "--set",
        "checkpoint.every=5",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let from = run_dir.to_str().unwrap();
    refused(
        &[
            "plan",
            "--from",
            from,
            "--nodes",
            "4294967296",
            "--workers-per-node",
            "4294967296",
        ],
        &["--nodes 4294967296"],
    );
    refused(
        &[
            "plan",
            "--from",
            from,
            "--workers-per-node",
            "2",
            "--cluster",
            "/dev/zero",
        ],
        &["--cluster /dev/zero", "not a regular file"],
    );
    refused(
        &["bench-collectives", "--sizes", "64G"],
        &["--sizes", "memory"],
    );
    refused(
        &["bench-collectives", "--sizes", "99999999999999G"],
        &["--sizes"],
    );
    refused(&["bench-collectives", "--op", "nope"], &["--op nope"]);
    refused(
        &["plan", "--from", "/dev", "--workers-per-node", "2"],
        &["config.toml"],
    );

    // Outputs that are not regular files are refused up front and left as they are.
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let link = tmp.path().join("link.json");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let fifo = tmp.path().join("fifo.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for path in [link.as_path(), fifo.as_path(), Path::new("/dev/full")] {
        let p = path.to_str().unwrap();
        refused(
            &[
                "plan",
                "--from",
                from,
                "--workers-per-node",
                "2",
                "--json",
                p,
            ],
            &[p, "not a regular file"],
        );
        refused(
            &["bench-collectives", "--json", p],
            &[p, "not a regular file"],
        );
        refused(&["bench", "--out", p], &[p, "not a regular file"]);
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
}
