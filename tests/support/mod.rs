//! Shared by the integration tests: real `redis-server` processes on free loopback ports, the
//! table of test vectors that runs against both the Rust algorithms and the Lua scripts, and
//! (in `web`) a real axum server, a real HTTP client, failing stores and Structured Fields
//! readers for the HTTP tests.
#![allow(dead_code, unreachable_pub, unused_imports)]

pub mod grpc;
pub mod vectors;
mod web;

pub use web::*;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Whether the Redis binaries are here. Without them: under CI (`CI=true`) the test fails,
/// elsewhere it prints a loud skip message and the caller returns.
pub fn redis_available() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !found {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!(
                "redis-server is not installed, and CI=true: install redis-server and redis-tools"
            );
        }
        eprintln!();
        eprintln!("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!");
        eprintln!("!!! SKIPPED: redis-server not found; install it to run the Redis tests !!!");
        eprintln!("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!");
    }
    found
}

/// Starts a Redis server, or returns from the test when Redis is not installed (see
/// [`redis_available`]).
#[macro_export]
macro_rules! redis_or_skip {
    () => {
        match $crate::support::RedisServer::start() {
            Some(server) => server,
            None => return,
        }
    };
}

/// A free loopback port whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A `redis-server` of its own, killed (and its directory removed) on drop.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    cluster: bool,
    /// More `redis-server` arguments (`--maxmemory 2mb`...), kept across restarts.
    extra: Vec<String>,
}

impl RedisServer {
    /// A single node on a free port, or None (after the skip message) without Redis.
    pub fn start() -> Option<Self> {
        if !redis_available() {
            return None;
        }
        Some(Self::spawn(free_port(), false))
    }

    /// A single node started with more arguments (such as `["--maxmemory", "2mb"]`), or None
    /// (after the skip message) without Redis.
    pub fn start_with(args: &[&str]) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        Some(Self::spawn_with(
            free_port(),
            false,
            args.iter().map(|a| a.to_string()).collect(),
        ))
    }

    /// A single node on `port` (see [`free_port`]); Redis must be installed.
    pub fn start_on(port: u16) -> Self {
        Self::spawn(port, false)
    }

    fn spawn(port: u16, cluster: bool) -> Self {
        Self::spawn_with(port, cluster, Vec::new())
    }

    fn spawn_with(port: u16, cluster: bool, extra: Vec<String>) -> Self {
        let dir =
            std::env::temp_dir().join(format!("tollgate-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut s = Self {
            child: None,
            port,
            dir,
            cluster,
            extra,
        };
        s.launch();
        s
    }

    fn launch(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--dir", self.dir.to_str().expect("utf-8 path")])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-node-timeout", "2000"]);
        }
        cmd.args(&self.extra);
        self.child = Some(cmd.spawn().expect("start redis-server"));
        // Wait for the process to accept commands (bounded).
        for _ in 0..200 {
            if self.cli(&["PING"]).trim() == "PONG" {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("redis-server on port {} did not start", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs `redis-cli` against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Sends `signal` (`STOP`, `CONT`...) to the server's process.
    pub fn signal(&self, signal: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([format!("-{signal}"), c.id().to_string()])
                .status();
        }
    }

    /// Kills the server (SIGKILL) and waits for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port (empty: nothing was saved).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Sentinel watching `master` as `mymaster`, killed on drop.
pub struct RedisSentinel {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl RedisSentinel {
    pub fn start(master: &RedisServer) -> Self {
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("tollgate-sentinel-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {} 1\nsentinel down-after-milliseconds mymaster 2000\n",
                dir.display(),
                master.port
            ),
        )
        .expect("sentinel.conf");
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server --sentinel");
        let s = Self { child, port, dir };
        for _ in 0..300 {
            let out = Command::new("redis-cli")
                .args([
                    "-p",
                    &port.to_string(),
                    "SENTINEL",
                    "get-master-addr-by-name",
                    "mymaster",
                ])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            if out.contains(&master.port.to_string()) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the sentinel did not start");
    }
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A three-master Redis Cluster, no replicas.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> Option<Self> {
        Self::start_with(&[])
    }

    /// A cluster whose nodes start with more arguments (such as
    /// `["--cluster-require-full-coverage", "no"]`), or None (after the skip message) without
    /// Redis.
    pub fn start_with(args: &[&str]) -> Option<Self> {
        if !redis_available() {
            return None;
        }
        let extra: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::spawn_with(free_port(), true, extra.clone()))
            .collect();
        let mut args = vec!["--cluster".to_owned(), "create".to_owned()];
        args.extend(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(String::from));
        let out = Command::new("redis-cli")
            .args(&args)
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        for _ in 0..500 {
            if nodes
                .iter()
                .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
            {
                return Some(Self { nodes });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the cluster did not become ready");
    }

    pub fn nodes(&self) -> Vec<(String, u16)> {
        self.nodes
            .iter()
            .map(|n| ("127.0.0.1".to_owned(), n.port))
            .collect()
    }

    /// Which of `nodes` holds the key named `name` (a Redis key name, hash tag included), by
    /// the Cluster's own map as the node `ask` sees it (`CLUSTER KEYSLOT`, `CLUSTER NODES`):
    /// it works while another node is down.
    pub fn node_of(&self, ask: usize, name: &str) -> usize {
        let asked = &self.nodes[ask];
        let slot: u16 = asked
            .cli(&["CLUSTER", "KEYSLOT", name])
            .trim()
            .parse()
            .expect("CLUSTER KEYSLOT");
        for line in asked.cli(&["CLUSTER", "NODES"]).lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = fields
                .get(1)
                .and_then(|a| a.split('@').next())
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            let holds = fields.iter().skip(8).any(|range| {
                let mut ends = range.split('-').map(|s| s.parse::<u16>());
                match (ends.next(), ends.next()) {
                    (Some(Ok(a)), Some(Ok(b))) => (a..=b).contains(&slot),
                    (Some(Ok(a)), None) => a == slot,
                    _ => false,
                }
            });
            if holds {
                if let Some(i) = self.nodes.iter().position(|n| n.port == port) {
                    return i;
                }
            }
        }
        panic!("no node holds slot {slot}");
    }
}

/// Every key on `server` (SCAN) with its PTTL.
pub fn keys_with_ttl(server: &RedisServer) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    let mut cursor = "0".to_owned();
    loop {
        let reply = server.cli(&["SCAN", &cursor, "COUNT", "1000"]);
        let mut lines = reply.lines();
        cursor = lines.next().unwrap_or("0").trim().to_owned();
        for key in lines {
            if key.is_empty() {
                continue;
            }
            let ttl = server.cli(&["PTTL", key]).trim().parse().unwrap_or(-3);
            out.push((key.to_owned(), ttl));
        }
        if cursor == "0" {
            return out;
        }
    }
}
