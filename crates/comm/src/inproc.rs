//! In-process transport: ranks are threads of one process. Used by tests and by single-process
//! simulations. Sends copy into an unbounded mailbox per directed pair, so they never block.
//! When a rank's transport is dropped (its thread ended or panicked) its peers see `Closed`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::error::{LinkFailure, TransportError};
use crate::transport::{Tag, Transport};

struct Mailbox {
    queue: Mutex<VecDeque<(Tag, Vec<u8>)>>,
    ready: Condvar,
}

struct Shared {
    world: usize,
    /// `boxes[from * world + to]`
    boxes: Vec<Mailbox>,
    alive: Vec<AtomicBool>,
}

pub struct InProcTransport {
    rank: usize,
    shared: Arc<Shared>,
    bytes_sent: AtomicU64,
}

/// Create `world` connected transports, one per rank (hand each to its own thread).
pub fn in_process_group(world: usize) -> Vec<InProcTransport> {
    let shared = Arc::new(Shared {
        world,
        boxes: (0..world * world)
            .map(|_| Mailbox {
                queue: Mutex::new(VecDeque::new()),
                ready: Condvar::new(),
            })
            .collect(),
        alive: (0..world).map(|_| AtomicBool::new(true)).collect(),
    });
    (0..world)
        .map(|rank| InProcTransport {
            rank,
            shared: shared.clone(),
            bytes_sent: AtomicU64::new(0),
        })
        .collect()
}

impl InProcTransport {
    fn mailbox(&self, from: usize, to: usize) -> &Mailbox {
        &self.shared.boxes[from * self.shared.world + to]
    }
    fn check_peer(&self, peer: usize) -> Result<(), TransportError> {
        if peer >= self.shared.world {
            return Err(TransportError::send(
                peer,
                self.peer_addr(peer),
                LinkFailure::Protocol(format!(
                    "rank {peer} is outside world of {}",
                    self.shared.world
                )),
            ));
        }
        Ok(())
    }
}

impl Drop for InProcTransport {
    fn drop(&mut self) {
        self.shared.alive[self.rank].store(false, Ordering::SeqCst);
        for peer in 0..self.shared.world {
            let mb = self.mailbox(self.rank, peer);
            let _guard = mb.queue.lock().unwrap_or_else(|e| e.into_inner());
            mb.ready.notify_all();
        }
    }
}

impl Transport for InProcTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn peer_addr(&self, peer: usize) -> String {
        format!("inproc:{peer}")
    }
    fn name(&self) -> &'static str {
        "inproc"
    }

    fn send(
        &self,
        peer: usize,
        tag: Tag,
        data: &[u8],
        _deadline: Instant,
    ) -> Result<(), TransportError> {
        self.check_peer(peer)?;
        if !self.shared.alive[peer].load(Ordering::SeqCst) {
            return Err(TransportError::send(
                peer,
                self.peer_addr(peer),
                LinkFailure::Closed,
            ));
        }
        let mb = self.mailbox(self.rank, peer);
        mb.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((tag, data.to_vec()));
        mb.ready.notify_all();
        self.bytes_sent
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn recv(
        &self,
        peer: usize,
        tag: Tag,
        buf: &mut [u8],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        self.check_peer(peer)?;
        let mb = self.mailbox(peer, self.rank);
        let started = Instant::now();
        let mut queue = mb.queue.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some((got_tag, data)) = queue.pop_front() {
                if got_tag != tag || data.len() != buf.len() {
                    return Err(TransportError::recv(
                        peer,
                        self.peer_addr(peer),
                        LinkFailure::Protocol(format!(
                            "expected tag {tag:#x} with {} bytes, got tag {got_tag:#x} with {} bytes",
                            buf.len(),
                            data.len()
                        )),
                    ));
                }
                buf.copy_from_slice(&data);
                return Ok(());
            }
            if !self.shared.alive[peer].load(Ordering::SeqCst) {
                return Err(TransportError::recv(
                    peer,
                    self.peer_addr(peer),
                    LinkFailure::Closed,
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::recv(
                    peer,
                    self.peer_addr(peer),
                    LinkFailure::Timeout(now - started),
                ));
            }
            queue = mb
                .ready
                .wait_timeout(queue, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn send_recv_tagged(
        &self,
        to: usize,
        send: &[u8],
        send_tag: Tag,
        from: usize,
        recv: &mut [u8],
        recv_tag: Tag,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        // Sends never block in-process, so sending first cannot deadlock.
        self.send(to, send_tag, send, deadline)?;
        self.recv(from, recv_tag, recv, deadline)
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }
}
