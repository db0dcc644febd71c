//! The etcd client against a real 3-member etcd cluster on loopback (Debian's `etcd-server`).
//! Ignored by `cargo test` (it needs the package); `scripts/netns-etcd.sh` installs it and runs
//! these with `--ignored`, and fails when `etcd` is missing.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lockstep_comm::etcd::EtcdClient;

struct Cluster {
    members: Vec<Option<Child>>,
    clients: Vec<String>,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let clients: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let peers: Vec<String> = (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let initial: Vec<String> = (0..3)
            .map(|i| format!("e{i}=http://{}", peers[i]))
            .collect();
        let members = (0..3)
            .map(|i| {
                let child = Command::new("etcd")
                    .args(["--name", &format!("e{i}")])
                    .arg("--data-dir")
                    .arg(dir.path().join(format!("e{i}")))
                    .args(["--listen-client-urls", &format!("http://{}", clients[i])])
                    .args(["--advertise-client-urls", &format!("http://{}", clients[i])])
                    .args(["--listen-peer-urls", &format!("http://{}", peers[i])])
                    .args([
                        "--initial-advertise-peer-urls",
                        &format!("http://{}", peers[i]),
                    ])
                    .args(["--initial-cluster", &initial.join(",")])
                    .args(["--initial-cluster-token", "lockstep-test"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("etcd (Debian's etcd-server) is not installed");
                Some(child)
            })
            .collect();
        let c = Cluster {
            members,
            clients,
            _dir: dir,
        };
        let client = c.client();
        let started = Instant::now();
        while client.put("ready", b"1").is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "etcd never became ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn client(&self) -> EtcdClient {
        EtcdClient::new(self.clients.clone())
            .unwrap()
            .with_timeout(Duration::from_secs(3))
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

#[test]
#[ignore = "needs Debian's etcd-server: run by scripts/netns-etcd.sh"]
fn the_client_reads_writes_and_counts_on_a_real_cluster_and_names_a_lost_quorum() {
    let mut cluster = Cluster::start();
    let c = cluster.client();
    c.put("/t/a", b"one").unwrap();
    assert_eq!(c.get("/t/a").unwrap().unwrap().value, b"one");
    assert!(c.get("/t/none").unwrap().is_none());
    // Exactly one of several racing creators wins.
    let winners: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let c = cluster.client();
                s.spawn(move || {
                    c.put_if_absent("/t/leader", format!("{i}").as_bytes())
                        .unwrap()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| usize::from(h.join().unwrap()))
            .sum()
    });
    assert_eq!(winners, 1);
    // Concurrent adds all count.
    std::thread::scope(|s| {
        for _ in 0..4 {
            let c = cluster.client();
            s.spawn(move || {
                for _ in 0..25 {
                    c.add("/t/counter", 1).unwrap();
                }
            });
        }
    });
    assert_eq!(c.add("/t/counter", 0).unwrap(), 100);
    c.delete_prefix("/t/").unwrap();
    assert!(c.get("/t/a").unwrap().is_none());
    assert_eq!(c.get("ready").unwrap().unwrap().value, b"1");
    // One member lost: the others still answer (the client tries the next endpoint).
    cluster.kill(0);
    c.put("/t/after", b"x").unwrap();
    assert_eq!(c.add("/t/n", 2).unwrap(), 2);
    // Two of three lost: no quorum, and the error names the cluster.
    cluster.kill(1);
    let started = Instant::now();
    let e = c.put("/t/nope", b"x").unwrap_err().to_string();
    assert!(e.contains("the etcd cluster at"), "{e}");
    assert!(e.contains(&cluster.clients[2]), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}
