//! Node agents of one job on the loopback interface: no root, no network namespaces. Each agent is
//! the real `lockstep train --nnodes …` in its own process group (a "host": its agent and its
//! workers), so a host can be lost whole. The same cases run across simulated hosts in
//! `scripts/netns-agents.sh` and `scripts/netns-elastic-nodes.sh`.

mod common;

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, lockstep, param_hash, summary};

/// The digits MLP, long enough (rank 0 slowed down) for a host to be lost and to come back.
const CONFIG: [&str; 8] = [
    "--set",
    "train.steps=60",
    "--set",
    "train.microbatch=8",
    "--set",
    "checkpoint.every=10",
    "--set",
    "dist.timeout_secs=20",
];
/// One case at a time: agents judge each other by 3-second heartbeats, and four jobs sharing two
/// cores must not starve one into looking lost.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every agent's wait for another is bounded; this bounds the test's.
const DEADLINE: Duration = Duration::from_secs(180);

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// One node's agent, in its own process group with its workers.
struct Host {
    child: Option<Child>,
    log: PathBuf,
}

impl Host {
    fn start(
        node: usize,
        nnodes: &str,
        port: u16,
        out: &Path,
        log: PathBuf,
        extra: &[&str],
    ) -> Host {
        let node = node.to_string();
        let rdzv = format!("127.0.0.1:{port}");
        let mut args = vec![
            "train",
            "--nproc",
            "1",
            "--nnodes",
            nnodes,
            "--node-rank",
            &node,
            "--rdzv",
            &rdzv,
            "--out",
            out.to_str().unwrap(),
            "--heartbeat-timeout",
            "3",
        ];
        args.extend(CONFIG);
        args.extend(extra);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = lockstep(&args)
            .env("LOCKSTEP_SECRET", SECRET)
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file))
            .process_group(0)
            .spawn()
            .expect("spawn lockstep");
        Host {
            child: Some(child),
            log,
        }
    }

    /// SIGKILL the agent and its workers at once: the host is gone.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: a signal to the process group this test created.
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    fn wait(&mut self) -> ExitStatus {
        let child = self.child.as_mut().expect("running");
        let started = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "agent still running after {DEADLINE:?}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A fixed job secret (the agents of one job share it).
const SECRET: &str = "6c6f636b737465702d6167656e74732d746573742d7365637265742d30303031";

/// The one-worker run's hash, with `extra` arguments after [`CONFIG`].
fn reference(dir: &Path, extra: &[&str]) -> String {
    let out = dir.join("one");
    let mut args = vec!["train", "--nproc", "1", "--out", out.to_str().unwrap()];
    args.extend(CONFIG);
    args.extend(extra);
    assert_ok(&lockstep(&args).output().unwrap());
    param_hash(&out)
}

/// Until node 0's run directory shows `step` done (its metrics file has that many lines).
fn wait_for_step(out: &Path, step: usize, host: &Host) {
    let started = Instant::now();
    loop {
        let lines = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= step {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the job never reached step {step}:\n{}",
            host.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn membership(out: &Path) -> Vec<(String, usize, usize)> {
    summary(out)["membership"]
        .as_array()
        .expect("membership")
        .iter()
        .map(|c| {
            (
                c["change"].as_str().unwrap().to_string(),
                c["world_before"].as_u64().unwrap() as usize,
                c["world_after"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

/// A worker killed on node 1: both agents stop their workers and restart together from the last
/// checkpoint, to the bits of one worker; node 0's summary blames the killed rank.
#[test]
fn agents_restart_together_after_a_worker_is_killed() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let want = reference(tmp.path(), &[]);
    let port = free_port();
    let fault = ["--max-restarts", "2", "--inject", "kill:rank=1,step=25"];
    let mut hosts: Vec<Host> = (0..2)
        .map(|n| {
            let out = tmp.path().join(format!("n{n}"));
            Host::start(
                n,
                "2",
                port,
                &out,
                tmp.path().join(format!("n{n}.log")),
                &fault,
            )
        })
        .collect();
    for h in &mut hosts {
        let status = h.wait();
        assert!(status.success(), "{status:?}:\n{}", h.output());
    }
    let s = summary(&tmp.path().join("n0"));
    assert_eq!(s["restarts"], 1, "{}", hosts[0].output());
    assert_eq!(s["failures"][0]["rank"], 1);
    assert!(s["failures"][0]["what"]
        .as_str()
        .unwrap()
        .contains("SIGKILL"));
    assert_eq!(param_hash(&tmp.path().join("n0")), want);
    assert!(
        hosts[1].output().contains("restart 1/2"),
        "{}",
        hosts[1].output()
    );
}

/// Agents that disagree on the restart policy are refused before any worker starts: exit 3 on
/// every node, naming the node that disagrees.
#[test]
fn agents_that_disagree_are_refused_before_any_worker_starts() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut hosts: Vec<Host> = [("0", "1"), ("1", "2")]
        .iter()
        .enumerate()
        .map(|(n, (_, restarts))| {
            let out = tmp.path().join(format!("n{n}"));
            let log = tmp.path().join(format!("n{n}.log"));
            Host::start(n, "2", port, &out, log, &["--max-restarts", restarts])
        })
        .collect();
    for h in &mut hosts {
        let status = h.wait();
        assert_eq!(status.code(), Some(3), "{}", h.output());
        assert!(h.output().contains("node 1"), "{}", h.output());
        assert!(h.output().contains("--max-restarts 2"), "{}", h.output());
    }
    assert!(!tmp.path().join("n0").join("metrics.jsonl").exists());
}

/// `--nnodes 2:3`: node 2 is lost whole (agent and worker), the job goes on with nodes 0 and 1;
/// node 2's agent starts again and is admitted at a checkpoint. Same bits as one worker, and both
/// changes on the membership timeline.
#[test]
fn an_elastic_job_loses_a_node_and_admits_it_again() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    // Long enough for node 2's agent to start again and be admitted.
    let steps = ["--set", "train.steps=300"];
    let want = reference(tmp.path(), &steps);
    let port = free_port();
    let slow = [
        "--max-restarts",
        "3",
        "--inject",
        "slow:rank=0,factor=20",
        steps[0],
        steps[1],
    ];
    let out = |n: usize| tmp.path().join(format!("n{n}"));
    let log = |n: usize| tmp.path().join(format!("n{n}.log"));
    let mut hosts: Vec<Host> = (0..3)
        .map(|n| Host::start(n, "2:3", port, &out(n), log(n), &slow))
        .collect();
    wait_for_step(&out(0), 15, &hosts[0]);
    hosts[2].kill();
    wait_for_step(&out(0), 35, &hosts[0]);
    hosts[2] = Host::start(2, "2:3", port, &out(2), log(2), &slow);
    for h in &mut hosts {
        let status = h.wait();
        assert!(status.success(), "{status:?}:\n{}", h.output());
    }
    let changes = membership(&out(0));
    assert_eq!(
        changes,
        [("node lost".into(), 3, 2), ("node joined".into(), 2, 3)],
        "{}",
        hosts[0].output()
    );
    assert_eq!(param_hash(&out(0)), want);
}

/// Node 0 (the store, rank 0, the checkpoints) is lost whole. With one run directory for all
/// nodes, the store moves to node 1, rank 0 with it, and the job goes on with nodes 1 and 2 to
/// the bits of one worker.
#[test]
fn losing_node_0_moves_the_store_and_the_job_goes_on() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let want = reference(tmp.path(), &[]);
    let port = free_port();
    let slow = ["--max-restarts", "3", "--inject", "slow:rank=0,factor=20"];
    let out = tmp.path().join("run");
    let log = |n: usize| tmp.path().join(format!("n{n}.log"));
    let mut hosts: Vec<Host> = (0..3)
        .map(|n| Host::start(n, "2:3", port, &out, log(n), &slow))
        .collect();
    wait_for_step(&out, 15, &hosts[0]);
    hosts[0].kill();
    for h in &mut hosts[1..] {
        let status = h.wait();
        assert!(status.success(), "{status:?}:\n{}", h.output());
    }
    assert!(
        hosts[2].output().contains("the store moves to node 1"),
        "{}",
        hosts[2].output()
    );
    assert_eq!(membership(&out), [("node lost".into(), 3, 2)]);
    assert_eq!(param_hash(&out), want);
}
