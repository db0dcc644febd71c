#![allow(dead_code)] // each including test uses a part of it
//! A fresh directory for one test's shared-memory files (removed on drop) and a job id nobody
//! else uses. Included with `#[path]` by the tests that need it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lockstep_comm::shm::ShmOptions;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

pub struct Scratch {
    pub dir: PathBuf,
    pub job: String,
}

impl Scratch {
    pub fn new() -> Scratch {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("lockstep-shm-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch {
            dir,
            job: format!("t{:x}-{n}", std::process::id()),
        }
    }

    pub fn opts(&self, ring_bytes: usize) -> ShmOptions {
        ShmOptions {
            ring_bytes,
            dir: self.dir.clone(),
        }
    }

    pub fn files(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    pub fn assert_empty(&self) {
        assert_eq!(
            self.files(),
            Vec::<String>::new(),
            "files left behind in {}",
            self.dir.display()
        );
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
