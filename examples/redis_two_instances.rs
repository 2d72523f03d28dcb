//! cargo run --example redis_two_instances --features redis
//!
//! Two instances of one service share one limit through Redis. Each instance has its own
//! `RedisStore` (its own connections, as two processes would); together they admit exactly
//! the limit, however the requests are split between them. Set `TOLLGATE_REDIS_URL` to use
//! another server than redis://127.0.0.1:6379.

use tollgate::store::redis::RedisStore;
use tollgate::{Policy, Rate};

/// Sends `requests` requests for one client, alternately to each instance, all at once, and
/// returns how many each instance admitted.
async fn two_instances(url: &str, requests: u32) -> Result<(u32, u32), Box<dyn std::error::Error>> {
    let a = RedisStore::connect(url).await?;
    let b = RedisStore::connect(url).await?;
    // 10 requests per minute per client, bursts of 10 (GCRA).
    let policy = Policy::gcra(Rate::per_minute(10), 10)?.named("per-minute")?;
    // A fresh client name per run, so that runs do not share their limit.
    let client = format!("demo-client:{}", std::process::id());
    let mut tasks = Vec::new();
    for i in 0..requests {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (policy, client) = (policy.clone(), client.clone());
        tasks.push(tokio::spawn(async move {
            let d = store.check(&client, &policy, 1).await?;
            Ok::<_, tollgate::StoreError>((i % 2, d))
        }));
    }
    let (mut by_a, mut by_b) = (0, 0);
    for t in tasks {
        let (instance, d) = t.await??;
        match (d.allowed(), instance) {
            (true, 0) => by_a += 1,
            (true, _) => by_b += 1,
            (false, _) => {}
        }
    }
    Ok((by_a, by_b))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("TOLLGATE_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    println!("Redis: {url}");
    let (a, b) = two_instances(&url, 100).await?;
    println!(
        "100 requests, limit 10 per minute: instance A admitted {a}, instance B admitted {b}, together {}",
        a + b
    );
    assert_eq!(a + b, 10, "the two instances must share one limit");
    Ok(())
}
