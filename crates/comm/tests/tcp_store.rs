//! The authenticated rendezvous store and the TCP transport, over 127.0.0.1 only.

mod common;
use common::waited_in_message;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_comm::auth::{connector_proof, JobSecret};
use lockstep_comm::store::{StoreClient, StoreServer};
use lockstep_comm::tcp::{TcpOptions, TcpTransport};
use lockstep_comm::{Algorithm, CommError, Communicator, LinkFailure, ReduceOp, Transport};

const LOCAL: &str = "127.0.0.1:0";
const LONG: Duration = Duration::from_secs(30);

fn server(secret: &JobSecret, job: &str) -> StoreServer {
    StoreServer::bind(LOCAL.parse().unwrap(), secret, job).unwrap()
}

fn client(addr: SocketAddr, secret: &JobSecret, job: &str) -> StoreClient {
    StoreClient::connect(addr, secret, job, Duration::from_secs(10)).unwrap()
}

fn soon() -> Instant {
    Instant::now() + LONG
}

/// Wait (bounded) until the server has refused `n` connections; refusals happen on the server's
/// connection threads, so they trail the client's view of the closed socket slightly.
fn wait_refused(s: &StoreServer, n: u64) {
    let until = Instant::now() + Duration::from_secs(5);
    while s.refused_connections() < n && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(s.refused_connections(), n);
}

/// Read until the remote closes; a reset (it hung up with our bytes unread) counts as closed.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("expected the server to close the connection, got {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------------------

/// Namespaces keep attempts apart on one store: a key set under `g1/` is invisible to a client
/// in `g2/`, visible under its full name to a plain client, and `wait_all` names the missing keys
/// without the prefix the caller never wrote.
#[test]
fn store_namespaces_separate_attempts() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-ns");
    let addr = srv.local_addr();
    let mut plain = client(addr, &secret, "job-ns");
    let mut g1 = client(addr, &secret, "job-ns").with_namespace("g1/");
    let mut g2 = client(addr, &secret, "job-ns").with_namespace("g2/");
    g1.set("host/0", b"one").unwrap();
    assert_eq!(g2.try_get("host/0").unwrap(), None);
    assert_eq!(g1.get("host/0", LONG).unwrap(), b"one");
    assert_eq!(plain.get("g1/host/0", LONG).unwrap(), b"one");
    assert_eq!(g2.add("arrived", 2).unwrap(), 2);
    assert_eq!(g1.add("arrived", 1).unwrap(), 1);
    assert_eq!(plain.add("g2/arrived", 0).unwrap(), 2);
    let e = g2
        .wait_all(&["host/0".to_string()], Duration::from_millis(200))
        .unwrap_err()
        .to_string();
    assert!(e.contains("['host/0']"), "{e}");
}

#[test]
fn store_set_get_add_and_wait_across_clients() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-a");
    let addr = srv.local_addr();
    let n = 4;
    let results: Vec<(i64, Vec<Vec<u8>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let secret = &secret;
                s.spawn(move || {
                    let mut c = client(addr, secret, "job-a");
                    // Set in rank order (each waits for its predecessor's key through the
                    // store itself), so later ranks' `get`s really wait for a later `set`.
                    if rank > 0 {
                        c.get(&format!("addr/{}", rank - 1), LONG).unwrap();
                    }
                    c.set(
                        &format!("addr/{rank}"),
                        format!("value of {rank}").as_bytes(),
                    )
                    .unwrap();
                    let counted = c.add("arrived", rank as i64 + 1).unwrap();
                    let keys: Vec<String> = (0..n).map(|r| format!("addr/{r}")).collect();
                    c.wait_all(&keys, LONG).unwrap();
                    let values = keys.iter().map(|k| c.get(k, LONG).unwrap()).collect();
                    (counted, values)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut counts: Vec<i64> = results.iter().map(|r| r.0).collect();
    counts.sort();
    // Each add returned the running total at its turn: a subset-sum chain ending at 1+2+3+4.
    assert_eq!(*counts.last().unwrap(), 10);
    assert!(
        counts.windows(2).all(|w| w[0] < w[1]),
        "counter values must be distinct: {counts:?}"
    );
    for (_, values) in &results {
        for (r, v) in values.iter().enumerate() {
            assert_eq!(v, format!("value of {r}").as_bytes());
        }
    }
    let mut c = client(addr, &secret, "job-a");
    assert_eq!(c.get("arrived", LONG).unwrap(), b"10");
    assert_eq!(c.add("arrived", -10).unwrap(), 0);
    assert_eq!(c.try_get("never-set").unwrap(), None);
    c.set("empty", b"").unwrap();
    assert_eq!(c.try_get("empty").unwrap(), Some(Vec::new()));
    c.set("big", &vec![7u8; 3 << 20]).unwrap();
    assert_eq!(c.get("big", LONG).unwrap(), vec![7u8; 3 << 20]);
    // A counter over a non-integer value is refused, and the client stays usable.
    let e = c.add("empty", 1).unwrap_err().to_string();
    assert!(e.contains("'empty'") && e.contains("not an integer"), "{e}");
    c.set("after", b"x").unwrap();
    assert_eq!(srv.refused_connections(), 0);
}

#[test]
fn missing_key_times_out_naming_the_key() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-t");
    let mut c = client(srv.local_addr(), &secret, "job-t");
    let t = Instant::now();
    let e = c
        .get("rank/3/address", Duration::from_millis(200))
        .unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(e, CommError::Rendezvous(_)), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("'rank/3/address'") && text.contains("timed out"),
        "{text}"
    );
    assert!(text.contains(&srv.local_addr().to_string()), "{text}");
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(3),
        "{waited:?}"
    );

    c.set("k/0", b"here").unwrap();
    let keys = vec!["k/0".to_string(), "k/1".to_string(), "k/2".to_string()];
    let text = c
        .wait_all(&keys, Duration::from_millis(150))
        .unwrap_err()
        .to_string();
    assert!(text.contains("['k/1', 'k/2']"), "{text}");
    // The client remains usable after timeouts.
    assert_eq!(c.get("k/0", LONG).unwrap(), b"here");
}

#[test]
fn store_refuses_strangers_and_keeps_serving() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-r");
    let addr = srv.local_addr();
    let mut good = client(addr, &secret, "job-r");
    good.set("before", b"1").unwrap();

    // A silent stranger occupies nothing but its own thread.
    let _silent = TcpStream::connect(addr).unwrap();

    // (a) garbage bytes.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let got = read_until_closed(&mut raw);
    assert!(
        got.len() <= 39,
        "the server must not answer garbage beyond its hello"
    );
    wait_refused(&srv, 1);

    // (b) wrong secret, (c) wrong job id: clear Auth errors that never show a secret.
    let other = JobSecret::generate().unwrap();
    let errors = [
        StoreClient::connect(addr, &other, "job-r", LONG)
            .err()
            .expect("wrong secret must fail"),
        StoreClient::connect(addr, &secret, "job-x", LONG)
            .err()
            .expect("wrong job must fail"),
    ];
    for e in &errors {
        assert!(matches!(e, CommError::Auth(_)), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(&format!(
                "store at {addr} refused authentication: wrong secret or job id"
            )),
            "{text}"
        );
        for s in [&secret, &other] {
            assert!(!text.contains(&s.to_hex()) && !format!("{e:?}").contains(&s.to_hex()));
        }
    }
    wait_refused(&srv, 3);

    // (d) an older protocol version, with an otherwise valid proof.
    let mut raw = TcpStream::connect(addr).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; 39];
    raw.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..4], b"LKST");
    let nonce_c = [9u8; 32];
    let mut proof = Vec::new();
    proof.extend_from_slice(b"LKST");
    proof.extend_from_slice(&0u16.to_le_bytes());
    proof.push(hello[6]);
    proof.extend_from_slice(&nonce_c);
    proof.extend_from_slice(&connector_proof(
        &secret,
        b"store|job-r",
        &hello[7..],
        &nonce_c,
    ));
    raw.write_all(&proof).unwrap();
    read_until_closed(&mut raw);
    wait_refused(&srv, 4);

    // Everyone legitimate is still served, old and new connections alike.
    assert_eq!(good.get("before", LONG).unwrap(), b"1");
    let mut fresh = client(addr, &secret, "job-r");
    fresh.set("after", b"2").unwrap();
    assert_eq!(good.get("after", LONG).unwrap(), b"2");
}

#[test]
fn client_waits_for_a_late_server_and_notices_it_stopping() {
    let secret = JobSecret::generate().unwrap();
    // Find a free port, release it, and start the server there only after the client is trying.
    // On 127.0.0.3, so that a concurrent test's listener on 127.0.0.1 cannot take the port.
    let addr = std::net::TcpListener::bind("127.0.0.3:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let s2 = secret.clone();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        StoreServer::bind(addr, &s2, "job-l").unwrap()
    });
    let mut c = StoreClient::connect(addr, &secret, "job-l", Duration::from_secs(10)).unwrap();
    c.set("k", b"v").unwrap();
    let mut srv = late.join().unwrap();
    srv.shutdown();
    let t = Instant::now();
    let e = c.get("k2", LONG).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "a stopped store must be noticed promptly"
    );
    assert!(e.to_string().contains(&format!("store at {addr}")), "{e}");
    // Nobody listens any more: connecting fails with a clear error once the timeout passes.
    let e = StoreClient::connect(addr, &secret, "job-l", Duration::from_millis(200))
        .err()
        .unwrap();
    assert!(
        e.to_string()
            .contains(&format!("could not reach store at {addr}")),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// TCP transport
// ---------------------------------------------------------------------------------------------

fn local_opts() -> TcpOptions {
    TcpOptions {
        bind_ip: "127.0.0.1".parse().unwrap(),
        connect_timeout: LONG,
        ..TcpOptions::default()
    }
}

/// Establish `world` ranks on threads through a real store.
fn mesh(world: usize, secret: &JobSecret, job: &str, store: SocketAddr) -> Vec<TcpTransport> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                s.spawn(move || {
                    let mut c = client(store, secret, job);
                    TcpTransport::establish(&mut c, rank, world, secret, job, &local_opts())
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic, distinct content for the message `from` → `to` of `len` bytes.
fn pattern(from: usize, to: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(31) ^ (from * 7 + to * 13 + len)) as u8)
        .collect()
}

const SIZES: [usize; 4] = [0, 1, 7919, (8 << 20) + 3];

#[test]
fn mesh_moves_all_sizes_both_ways_without_deadlock() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-m");
    let world = 4;
    let ts = mesh(world, &secret, "job-m", srv.local_addr());
    let sent: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = ts
            .iter()
            .map(|t| {
                s.spawn(move || {
                    let me = t.rank();
                    assert_eq!((t.world_size(), t.name()), (world, "tcp"));
                    let peers: Vec<usize> = (0..world).filter(|&p| p != me).collect();
                    for (k, &len) in SIZES.iter().enumerate() {
                        let tag = 100 + k as u64;
                        // Plain send and recv: everyone sends to everyone at once (from a second
                        // thread, sharing the transport) while receiving from everyone.
                        std::thread::scope(|inner| {
                            inner.spawn(|| {
                                for &p in &peers {
                                    t.send(p, tag, &pattern(me, p, len), soon()).unwrap();
                                }
                            });
                            for &p in &peers {
                                let mut buf = vec![0u8; len];
                                t.recv(p, tag, &mut buf, soon()).unwrap();
                                assert!(
                                    buf == pattern(p, me, len),
                                    "send/recv {p}->{me} of {len} bytes"
                                );
                            }
                        });
                        // send_recv around the ring (different peers in and out).
                        let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
                        let mut buf = vec![0u8; len];
                        t.send_recv(
                            next,
                            &pattern(me, next, len),
                            prev,
                            &mut buf,
                            tag + 50,
                            soon(),
                        )
                        .unwrap();
                        assert!(
                            buf == pattern(prev, me, len),
                            "ring {prev}->{me} of {len} bytes"
                        );
                        // send_recv with one partner both ways (one socket, both directions).
                        let partner = me ^ 1;
                        t.send_recv(
                            partner,
                            &pattern(me, partner, len),
                            partner,
                            &mut buf,
                            tag + 60,
                            soon(),
                        )
                        .unwrap();
                        assert!(
                            buf == pattern(partner, me, len),
                            "pair {partner}->{me} of {len} bytes"
                        );
                    }
                    t.bytes_sent()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let per_size: u64 = SIZES
        .iter()
        .map(|&l| l as u64 * (world as u64 - 1 + 2))
        .sum();
    assert_eq!(sent, vec![per_size; world]);
    for (r, t) in ts.iter().enumerate() {
        for p in (0..world).filter(|&p| p != r) {
            assert!(
                t.peer_addr(p).starts_with("127.0.0.1:"),
                "{}",
                t.peer_addr(p)
            );
        }
    }
    assert_eq!(srv.refused_connections(), 0);
}

#[test]
fn dropped_peer_is_reported_closed_promptly() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-d");
    let mut ts = mesh(3, &secret, "job-d", srv.local_addr());
    let gone = ts.pop().unwrap();
    let gone_addr = ts[0].peer_addr(2);
    std::thread::scope(|s| {
        for t in &ts {
            s.spawn(move || {
                let t0 = Instant::now();
                let mut buf = [0u8; 16];
                let e = t.recv(2, 1, &mut buf, soon()).unwrap_err();
                assert!(matches!(e.failure, LinkFailure::Closed), "{e}");
                assert_eq!(e.peer, 2);
                assert!(e.to_string().contains("rank 2 ("), "{e}");
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "took {:?}",
                    t0.elapsed()
                );
            });
        }
        // Whether the receivers are already blocked or not yet started, a vanished peer must
        // read as Closed (well before the 30 s deadline), so no sleep orders them.
        drop(gone);
    });
    let mut buf = [0u8; 16];
    let e = ts[0].recv(2, 1, &mut buf, soon()).unwrap_err();
    assert!(e.to_string().contains(&gone_addr), "{e}");
    // The surviving link between ranks 0 and 1 is unaffected.
    std::thread::scope(|s| {
        s.spawn(|| ts[1].send(0, 5, b"still here", soon()).unwrap());
        let mut buf = [0u8; 10];
        ts[0].recv(1, 5, &mut buf, soon()).unwrap();
        assert_eq!(&buf, b"still here");
    });
}

#[test]
fn silent_peer_times_out_and_mismatched_tags_are_protocol_errors() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-s");
    let ts = mesh(2, &secret, "job-s", srv.local_addr());
    let mut buf = vec![0u8; 1000];
    let t0 = Instant::now();
    let e = ts[0]
        .recv(1, 7, &mut buf, Instant::now() + Duration::from_millis(250))
        .unwrap_err();
    let waited = t0.elapsed();
    assert!(e.is_timeout(), "{e}");
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    let text = e.to_string();
    assert!(
        text.starts_with("timed out after ")
            && (0.2..2.0).contains(&waited_in_message(&text))
            && text.contains("waiting for rank 1 (127.0.0.1:"),
        "{text}"
    );
    // Nothing was consumed, so the link still works once the peer speaks.
    ts[1].send(0, 7, &pattern(1, 0, 1000), soon()).unwrap();
    ts[0].recv(1, 7, &mut buf, soon()).unwrap();
    assert_eq!(buf, pattern(1, 0, 1000));
    // send_recv blames the silent peer too, within its deadline.
    let e = ts[0]
        .send_recv(
            1,
            b"abc",
            1,
            &mut buf[..3],
            8,
            Instant::now() + Duration::from_millis(100),
        )
        .unwrap_err();
    assert!(e.is_timeout() && e.peer == 1, "{e}");
    let mut three = [0u8; 3];
    ts[1].recv(0, 8, &mut three, soon()).unwrap();
    assert_eq!(&three, b"abc");

    // A disagreement about tag or length is named, and the link refuses further use.
    ts[1].send(0, 42, &[1, 2, 3], soon()).unwrap();
    let mut four = [0u8; 4];
    let e = ts[0].recv(1, 41, &mut four, soon()).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e.failure, LinkFailure::Protocol(_)), "{e}");
    assert!(
        text.contains("expected tag 0x29 with 4 bytes, got tag 0x2a with 3 bytes"),
        "{text}"
    );
    let e = ts[0].recv(1, 43, &mut four, soon()).unwrap_err();
    assert!(
        e.to_string()
            .contains("link unusable after an earlier failure"),
        "{e}"
    );
}

/// A receiver asleep waiting for a long frame raises its receive low-water mark; a frame that
/// announces another length must still wake it and be reported as a protocol error, not leave it
/// asleep until its deadline because fewer bytes than the mark arrived.
#[test]
fn a_short_frame_wakes_a_receiver_waiting_for_a_long_one() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-w");
    let ts = mesh(2, &secret, "job-w", srv.local_addr());
    std::thread::scope(|s| {
        let deadline = Instant::now() + LONG;
        let receiver = &ts[0];
        let waiter = s.spawn(move || {
            let mut big = vec![0u8; 4 << 20];
            let r = receiver.recv(1, 9, &mut big, deadline);
            (r, Instant::now())
        });
        // Give the receiver time to go to sleep (the test holds either way).
        std::thread::sleep(Duration::from_millis(200));
        ts[1].send(0, 9, &[1, 2, 3], soon()).unwrap();
        let (r, returned) = waiter.join().unwrap();
        let e = r.unwrap_err();
        // Left asleep, it would notice the frame only when poll gives up at the deadline.
        assert!(returned < deadline, "woke only at the deadline: {e}");
        assert!(matches!(e.failure, LinkFailure::Protocol(_)), "{e}");
        assert!(
            e.to_string()
                .contains("expected tag 0x9 with 4194304 bytes, got tag 0x9 with 3 bytes"),
            "{e}"
        );
    });
}

#[test]
fn strangers_on_a_data_port_are_refused_and_the_mesh_still_forms() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-g");
    let store = srv.local_addr();
    let world = 3;
    std::thread::scope(|s| {
        // Ranks 0 and 1 start; rank 2 only after the strangers have had their go, so rank 0 is
        // still accepting when they arrive.
        let early: Vec<_> = (0..2)
            .map(|rank| {
                let secret = &secret;
                s.spawn(move || {
                    let mut c = client(store, secret, "job-g");
                    TcpTransport::establish(&mut c, rank, world, secret, "job-g", &local_opts())
                        .unwrap()
                })
            })
            .collect();
        let mut c = client(store, &secret, "job-g");
        let data_port: SocketAddr = String::from_utf8(c.get("tcp/0", LONG).unwrap())
            .unwrap()
            .parse()
            .unwrap();
        assert!(data_port.ip().is_loopback());

        // Garbage.
        let mut raw = TcpStream::connect(data_port).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        read_until_closed(&mut raw);

        // A rank of another job: right protocol, valid MAC for the wrong job id.
        let mut raw = TcpStream::connect(data_port).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut hello = [0u8; 39];
        raw.read_exact(&mut hello).unwrap();
        assert_eq!(hello[6], 2, "a data port announces itself as such");
        let nonce_c = [3u8; 32];
        let mut proof = b"LKST".to_vec();
        proof.extend_from_slice(&1u16.to_le_bytes());
        proof.push(2);
        proof.extend_from_slice(&nonce_c);
        proof.extend_from_slice(&connector_proof(
            &secret,
            b"tcp|other-job",
            &hello[7..],
            &nonce_c,
        ));
        raw.write_all(&proof).unwrap();
        let verdict = read_until_closed(&mut raw);
        assert_eq!(
            verdict.get(6),
            Some(&1),
            "refused with the 'bad authentication' verdict"
        );

        // A store client is not a data peer: pointing it at a data port says so.
        let e = StoreClient::connect(data_port, &secret, "job-g", LONG)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("is a lockstep TCP data port, not a lockstep rendezvous store"),
            "{e}"
        );

        let late = s.spawn(|| {
            let mut c = client(store, &secret, "job-g");
            TcpTransport::establish(&mut c, 2, world, &secret, "job-g", &local_opts()).unwrap()
        });
        let mut ts: Vec<TcpTransport> = early.into_iter().map(|h| h.join().unwrap()).collect();
        ts.push(late.join().unwrap());
        std::thread::scope(|s| {
            for t in &ts {
                s.spawn(move || {
                    let me = t.rank();
                    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
                    let mut buf = vec![0u8; 5000];
                    t.send_recv(next, &pattern(me, next, 5000), prev, &mut buf, 9, soon())
                        .unwrap();
                    assert_eq!(buf, pattern(prev, me, 5000));
                });
            }
        });
    });
}

#[test]
fn mesh_establishment_times_out_naming_missing_ranks() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-o");
    let mut c = client(srv.local_addr(), &secret, "job-o");
    let opts = TcpOptions {
        connect_timeout: Duration::from_millis(300),
        ..local_opts()
    };
    let t0 = Instant::now();
    let e = TcpTransport::establish(&mut c, 0, 3, &secret, "job-o", &opts)
        .err()
        .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3));
    let text = e.to_string();
    assert!(
        text.contains("rank 0: timed out after 0.")
            && text.contains("no link yet to rank(s) [1, 2]"),
        "{text}"
    );
    // A rank whose lower peer never publishes names the key it waited for.
    let e = TcpTransport::establish(
        &mut c,
        2,
        3,
        &secret,
        "job-o",
        &TcpOptions {
            store_prefix: "other".into(),
            ..opts
        },
    )
    .err()
    .unwrap();
    assert!(
        e.to_string()
            .contains("waiting for rank 0 to publish its address ('other/0'"),
        "{e}"
    );
}

#[test]
fn ranks_disagreeing_about_the_world_size_get_clear_errors() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-w");
    let store = srv.local_addr();
    let opts = TcpOptions {
        connect_timeout: Duration::from_secs(1),
        ..local_opts()
    };
    let (e0, e1) = std::thread::scope(|s| {
        let r0 = s.spawn(|| {
            let mut c = client(store, &secret, "job-w");
            TcpTransport::establish(&mut c, 0, 2, &secret, "job-w", &opts)
                .err()
                .unwrap()
        });
        let r1 = s.spawn(|| {
            let mut c = client(store, &secret, "job-w");
            TcpTransport::establish(&mut c, 1, 3, &secret, "job-w", &opts)
                .err()
                .unwrap()
        });
        (
            r0.join().unwrap().to_string(),
            r1.join().unwrap().to_string(),
        )
    });
    assert!(
        e1.contains("but it is rank 0 of world 2 (expected rank 0 of world 3"),
        "{e1}"
    );
    assert!(e0.contains("no link yet to rank(s) [1]"), "{e0}");
    assert!(
        e0.contains("peer says world size 3 but this rank has 2"),
        "{e0}"
    );
}

#[test]
fn communicator_all_reduce_over_tcp() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-c");
    let world = 3;
    let ts = mesh(world, &secret, "job-c", srv.local_addr());
    // Odd length so ring chunks are uneven; integers so every algorithm's sum is exact.
    let n = 100_003usize;
    std::thread::scope(|s| {
        for t in ts {
            s.spawn(move || {
                let r = t.rank() as i64;
                let mut comm = Communicator::new(Arc::new(t), LONG);
                for alg in [Algorithm::Ring, Algorithm::RecursiveDoubling] {
                    let mut buf: Vec<i64> = (0..n as i64).map(|i| i * (r + 1)).collect();
                    comm.all_reduce_with(&mut buf, ReduceOp::Sum, alg).unwrap();
                    // sum over r of i*(r+1) = i * (1+2+3)
                    assert!(
                        buf.iter().enumerate().all(|(i, &v)| v == 6 * i as i64),
                        "{alg}"
                    );
                }
                let mut small = [r as f32 + 0.5; 7];
                comm.all_reduce(&mut small, ReduceOp::Max).unwrap();
                assert_eq!(small, [2.5f32; 7]);
            });
        }
    });
}

/// Figures for the report: `cargo test -p lockstep-comm --test tcp_store -- --ignored --nocapture`.
/// Prints only; no timed assertions.
#[test]
#[ignore]
fn throughput_report() {
    let secret = JobSecret::generate().unwrap();
    let srv = server(&secret, "job-b");
    for buf_bytes in [0usize, 4 << 20] {
        let ts: Vec<TcpTransport> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let secret = &secret;
                    let store = srv.local_addr();
                    s.spawn(move || {
                        let mut c = client(store, secret, "job-b");
                        let opts = TcpOptions {
                            socket_buffer_bytes: buf_bytes,
                            store_prefix: format!("bench{buf_bytes}"),
                            ..local_opts()
                        };
                        TcpTransport::establish(&mut c, rank, 2, secret, "job-b", &opts).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Ping-pong latency, 4 KiB.
        let iters = 2000;
        let msg = vec![1u8; 4096];
        let elapsed = std::thread::scope(|s| {
            let (a, b) = (&ts[0], &ts[1]);
            s.spawn(|| {
                let mut buf = vec![0u8; 4096];
                for i in 0..iters {
                    b.recv(0, i, &mut buf, soon()).unwrap();
                    b.send(0, i, &buf, soon()).unwrap();
                }
            });
            let mut buf = vec![0u8; 4096];
            let t0 = Instant::now();
            for i in 0..iters {
                a.send(1, i, &msg, soon()).unwrap();
                a.recv(1, i, &mut buf, soon()).unwrap();
            }
            t0.elapsed()
        });
        println!(
            "sockbuf {buf_bytes}: 4 KiB ping-pong round trip {:.1} us",
            elapsed.as_secs_f64() * 1e6 / iters as f64
        );
        // Exchange throughput: both ranks send_recv 32 MiB to each other at once.
        for len in [4096usize, 1 << 20, 32 << 20] {
            let reps = (256 << 20) / len.max(1 << 16);
            let elapsed = std::thread::scope(|s| {
                let hs: Vec<_> = ts
                    .iter()
                    .map(|t| {
                        s.spawn(move || {
                            let out = vec![2u8; len];
                            let mut inc = vec![0u8; len];
                            let peer = 1 - t.rank();
                            t.send_recv(peer, &out, peer, &mut inc, 0, soon()).unwrap();
                            let t0 = Instant::now();
                            for i in 0..reps {
                                t.send_recv(peer, &out, peer, &mut inc, i as u64 + 1, soon())
                                    .unwrap();
                            }
                            t0.elapsed()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
            });
            let per = elapsed.as_secs_f64() / reps as f64;
            println!(
                "sockbuf {buf_bytes}: send_recv {len} B each way: {:.1} us/step, {:.2} GB/s per direction",
                per * 1e6,
                len as f64 / per / 1e9
            );
        }
    }
    // Communicator all-reduce, 2 ranks: bus bandwidth = 2(n-1)/n * bytes / time = bytes / time.
    let ts: Vec<TcpTransport> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let secret = &secret;
                let store = srv.local_addr();
                s.spawn(move || {
                    let mut c = client(store, secret, "job-b");
                    let opts = TcpOptions {
                        store_prefix: "bench-ar".into(),
                        ..local_opts()
                    };
                    TcpTransport::establish(&mut c, rank, 2, secret, "job-b", &opts).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    std::thread::scope(|s| {
        for t in ts {
            s.spawn(move || {
                let me = t.rank();
                let mut comm = Communicator::new(Arc::new(t), LONG);
                for (elems, reps) in [(1024usize, 2000usize), (16 << 20, 5)] {
                    let mut buf = vec![1.0f32; elems];
                    comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    // Line the ranks up (an all-reduce of one element is a barrier).
                    comm.all_reduce(&mut [0u8; 1], ReduceOp::Sum).unwrap();
                    let t0 = Instant::now();
                    for _ in 0..reps {
                        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                    }
                    let per = t0.elapsed().as_secs_f64() / reps as f64;
                    if me == 0 {
                        println!(
                            "all_reduce f32 x {elems} ({} B), 2 ranks: {:.1} us, bus bandwidth {:.2} GB/s",
                            elems * 4,
                            per * 1e6,
                            (elems * 4) as f64 / per / 1e9
                        );
                    }
                }
            });
        }
    });
    let src = vec![3u8; 64 << 20];
    let mut dst = vec![0u8; 64 << 20];
    dst.copy_from_slice(&src);
    let t0 = Instant::now();
    for _ in 0..10 {
        std::hint::black_box(&mut dst).copy_from_slice(std::hint::black_box(&src));
    }
    println!(
        "memcpy 64 MiB single thread: {:.2} GB/s",
        640.0 * 1048576.0 / t0.elapsed().as_secs_f64() / 1e9
    );
}
