//! A small client of etcd's v3 API through its JSON gateway (`POST /v3/kv/...`, etcd ≥ 3.4): the
//! few operations a rendezvous needs — put, get, create-if-absent, compare-and-swap, counters and
//! prefix deletion — over plain HTTP/1.1 on `std::net`, one connection per request.
//!
//! Why etcd: a rendezvous that outlives any one host. Its members agree by Raft, so a write is
//! accepted only by a majority; a host cut off with a minority of the members cannot write
//! (its requests fail), so two halves of a job can never both go on.
//!
//! Endpoints are tried in order, each with the request's own deadline; the first that answers
//! serves the request. When none does, the error names every endpoint and what each said, so a
//! lost quorum reads as "the etcd cluster at … does not answer".
//!
//! Keys and values travel base64-encoded (the gateway's encoding of `bytes`); 64-bit integers
//! travel as JSON strings. No authentication or TLS here: access to the etcd cluster is the trust
//! boundary (the workers' own links are still authenticated with the job's secret).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{CommError, Result};

/// How long one endpoint may take to answer (etcd itself gives up on a request it cannot commit
/// after about 7 s, so a member without quorum answers within this).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest answer read from an endpoint.
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// A client of one etcd cluster.
#[derive(Debug, Clone)]
pub struct EtcdClient {
    endpoints: Vec<String>,
    timeout: Duration,
}

/// A key's value and the revision that last changed it (for compare-and-swap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

impl EtcdClient {
    /// `endpoints`: `host:port` of each member (or of proxies), tried in this order.
    pub fn new(endpoints: Vec<String>) -> Result<EtcdClient> {
        if endpoints.is_empty() {
            return Err(CommError::invalid("etcd", "no endpoints"));
        }
        Ok(EtcdClient {
            endpoints,
            timeout: REQUEST_TIMEOUT,
        })
    }

    /// Parses `etcd://h1:2379,h2:2379` (the scheme is optional).
    pub fn from_url(url: &str) -> Result<EtcdClient> {
        let list = url.strip_prefix("etcd://").unwrap_or(url);
        let endpoints: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_string)
            .collect();
        for e in &endpoints {
            let port = e
                .rsplit_once(':')
                .map(|(host, port)| (host, port.parse::<u16>()));
            let valid = matches!(port, Some((host, Ok(_))) if !host.is_empty());
            if !valid {
                return Err(CommError::invalid(
                    "etcd",
                    format!("endpoint {e:?} in {url:?} is not HOST:PORT"),
                ));
            }
        }
        EtcdClient::new(endpoints)
    }

    /// Each endpoint's answer may take at most `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> EtcdClient {
        self.timeout = timeout;
        self
    }

    /// The endpoints, in the order they are tried.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The endpoints, for messages: "h1:2379, h2:2379".
    pub fn describe(&self) -> String {
        self.endpoints.join(", ")
    }

    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            "put",
            json!({ "key": b64(key.as_bytes()), "value": b64(value) }),
        )?;
        Ok(())
    }

    pub fn get(&self, key: &str) -> Result<Option<Versioned>> {
        let answer = self.call("range", json!({ "key": b64(key.as_bytes()) }))?;
        first_kv(&answer)
    }

    /// Writes `value` only if `key` does not exist; returns whether it did. Of several agents
    /// racing, exactly one wins.
    pub fn put_if_absent(&self, key: &str, value: &[u8]) -> Result<bool> {
        let k = b64(key.as_bytes());
        let answer = self.call(
            "txn",
            json!({
                "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
                "success": [{ "request_put": { "key": k, "value": b64(value) } }],
            }),
        )?;
        Ok(answer["succeeded"].as_bool().unwrap_or(false))
    }

    /// Writes `value` only if `key` was last changed at `mod_revision` (0: does not exist).
    pub fn compare_and_put(&self, key: &str, mod_revision: i64, value: &[u8]) -> Result<bool> {
        let k = b64(key.as_bytes());
        let answer = self.call(
            "txn",
            json!({
                "compare": [{ "key": k, "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision.to_string() }],
                "success": [{ "request_put": { "key": k, "value": b64(value) } }],
            }),
        )?;
        Ok(answer["succeeded"].as_bool().unwrap_or(false))
    }

    /// Adds `delta` to the decimal counter at `key` (absent = 0) and returns the new value;
    /// `delta = 0` reads it. Concurrent adds all count (compare-and-swap, retried).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        loop {
            let current = self.get(key)?;
            let (value, revision) = match &current {
                Some(v) => (parse_counter(key, &v.value)?, v.mod_revision),
                None => (0, 0),
            };
            if delta == 0 {
                return Ok(value);
            }
            let next = value + delta;
            if self.compare_and_put(key, revision, next.to_string().as_bytes())? {
                return Ok(next);
            }
        }
    }

    /// Removes every key that starts with `prefix`.
    pub fn delete_prefix(&self, prefix: &str) -> Result<()> {
        self.call(
            "deleterange",
            json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix.as_bytes())) }),
        )?;
        Ok(())
    }

    /// One request, to the first endpoint that answers it.
    fn call(&self, op: &str, body: Value) -> Result<Value> {
        let body = body.to_string();
        let mut said = Vec::new();
        for e in &self.endpoints {
            match post(e, &format!("/v3/kv/{op}"), &body, self.timeout) {
                Ok(answer) => return Ok(answer),
                Err(why) => said.push(format!("{e}: {why}")),
            }
        }
        Err(CommError::Rendezvous(format!(
            "the etcd cluster at {} does not answer ({op}): {}",
            self.describe(),
            said.join("; ")
        )))
    }
}

fn parse_counter(key: &str, raw: &[u8]) -> Result<i64> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| CommError::Rendezvous(format!("etcd key {key} is not a counter")))
}

fn first_kv(answer: &Value) -> Result<Option<Versioned>> {
    let Some(kv) = answer["kvs"].as_array().and_then(|k| k.first()) else {
        return Ok(None);
    };
    let value = match kv["value"].as_str() {
        Some(v) => unb64(v).ok_or_else(|| bad_answer("a value that is not base64"))?,
        None => Vec::new(),
    };
    let mod_revision = kv["mod_revision"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .ok_or_else(|| bad_answer("a key without mod_revision"))?;
    Ok(Some(Versioned {
        value,
        mod_revision,
    }))
}

fn bad_answer(what: &str) -> CommError {
    CommError::Rendezvous(format!("etcd answered with {what}"))
}

/// The smallest key greater than every key starting with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// POST `body` (JSON) to `http://endpoint{path}`; the decoded JSON answer of a 200, or why not.
fn post(
    endpoint: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> std::result::Result<Value, String> {
    let deadline = Instant::now() + timeout;
    let addr: SocketAddr = endpoint
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or("resolves to nothing")?;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    stream
        .set_write_timeout(Some(left()))
        .map_err(|e| e.to_string())?;
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    (&stream)
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(left()))
        .map_err(|e| e.to_string())?;
    let (status, answer) = read_response(BufReader::new(&stream))?;
    let json: Value = serde_json::from_slice(&answer)
        .map_err(|e| format!("HTTP {status} with an answer that is not JSON: {e}"))?;
    if status != 200 {
        let message = json["message"]
            .as_str()
            .or(json["error"].as_str())
            .unwrap_or("");
        return Err(format!("HTTP {status}: {message}"));
    }
    Ok(json)
}

/// Status and body of an HTTP/1.1 response (by Content-Length, chunked, or up to the close).
fn read_response<R: BufRead>(mut r: R) -> std::result::Result<(u16, Vec<u8>), String> {
    let io = |e: std::io::Error| e.to_string();
    let mut line = String::new();
    r.read_line(&mut line).map_err(io)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {:?}", line.trim_end()))?;
    let (mut length, mut chunked) = (None, false);
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(io)? == 0 {
            return Err("connection closed in the headers".into());
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            if name == "content-length" {
                length = Some(value.parse::<usize>().map_err(|_| "bad Content-Length")?);
            } else if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
    }
    let body = if chunked {
        read_chunked(&mut r)?
    } else if let Some(n) = length {
        if n > MAX_ANSWER_BYTES {
            return Err(format!("an answer of {n} bytes"));
        }
        let mut body = vec![0; n];
        r.read_exact(&mut body).map_err(io)?;
        body
    } else {
        let mut body = Vec::new();
        r.take(MAX_ANSWER_BYTES as u64)
            .read_to_end(&mut body)
            .map_err(io)?;
        body
    };
    Ok((status, body))
}

fn read_chunked<R: BufRead>(r: &mut R) -> std::result::Result<Vec<u8>, String> {
    let mut body = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).map_err(|e| e.to_string())?;
        let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
            .map_err(|_| format!("bad chunk size {:?}", line.trim()))?;
        if size == 0 {
            return Ok(body);
        }
        if body.len() + size > MAX_ANSWER_BYTES {
            return Err("an answer over the size limit".into());
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..])
            .map_err(|e| e.to_string())?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).map_err(|e| e.to_string())?;
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (the gateway's encoding of `bytes`).
fn b64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn unb64(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes() {
        let v = B64.iter().position(|&b| b == c)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_the_standard() {
        assert_eq!(b64(b""), "");
        assert_eq!(b64(b"f"), "Zg==");
        assert_eq!(b64(b"fo"), "Zm8=");
        assert_eq!(b64(b"foo"), "Zm9v");
        assert_eq!(b64(b"foobar"), "Zm9vYmFy");
        for n in 0..300usize {
            let data: Vec<u8> = (0..n).map(|i| (i * 37 + n) as u8).collect();
            assert_eq!(unb64(&b64(&data)).unwrap(), data);
        }
        assert!(unb64("Zm9v!").is_none());
    }

    #[test]
    fn prefix_ends_bound_exactly_the_prefix() {
        assert_eq!(prefix_end(b"/lockstep/a/"), b"/lockstep/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn responses_are_read_by_length_chunks_or_close() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(read_response(&plain[..]).unwrap(), (200, b"{}".to_vec()));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(
            read_response(&chunked[..]).unwrap().1,
            b"{\"a\":1}".to_vec()
        );
        let closed = b"HTTP/1.1 503 Service Unavailable\r\n\r\n{\"error\":\"x\"}";
        assert_eq!(read_response(&closed[..]).unwrap().0, 503);
        assert!(read_response(&b"SSH-2.0-OpenSSH\r\n"[..]).is_err());
        assert!(
            read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n"[..]).is_err()
        );
    }

    #[test]
    fn urls_name_their_endpoints_or_are_refused() {
        let c = EtcdClient::from_url("etcd://h1:2379, h2:2379,h3:2379").unwrap();
        assert_eq!(c.describe(), "h1:2379, h2:2379, h3:2379");
        assert!(EtcdClient::from_url("etcd://").is_err());
        assert!(EtcdClient::from_url("etcd://h1").is_err());
        assert!(EtcdClient::from_url("http://h1:2379/x").is_err());
    }

    /// With no member listening, the error names every endpoint.
    #[test]
    fn an_unreachable_cluster_is_named_endpoint_by_endpoint() {
        let free = |_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let endpoints: Vec<String> = (0..2).map(free).collect();
        let c = EtcdClient::new(endpoints.clone())
            .unwrap()
            .with_timeout(Duration::from_millis(500));
        let e = c.get("k").unwrap_err().to_string();
        for ep in &endpoints {
            assert!(e.contains(ep.as_str()), "{e}");
        }
        assert!(e.contains("does not answer"), "{e}");
    }
}
