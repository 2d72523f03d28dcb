//! The retry policy for reqwest, as a reqwest-middleware [`Middleware`].

use http::Extensions;
use reqwest_middleware::reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next, Result};

use super::policy::{GaveUp, Next as Step, RetryPolicy, RetryStats};

/// The [`RetryLayer`](super::RetryLayer)'s behaviour for reqwest (feature `reqwest`): a
/// [`reqwest_middleware::Middleware`] deciding through the same [`RetryPolicy`] (the server's
/// hints first, full jitter otherwise, the budget, the deadline, idempotent requests only).
///
/// A request is replayed with `reqwest::Request::try_clone`, so a request with a streaming
/// body is sent once. A response given up on carries a [`GaveUp`] in its extensions.
///
/// ```no_run
/// use reqwest_middleware::ClientBuilder;
/// use tollgate::client::{RetryMiddleware, RetryPolicy};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = ClientBuilder::new(reqwest_middleware::reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryPolicy::default()))
///     .build();
/// let answer = client.get("http://127.0.0.1:3000/").send().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default)]
pub struct RetryMiddleware {
    policy: RetryPolicy,
}

impl RetryMiddleware {
    /// A middleware deciding by `policy` (clones of one policy share its budget and stats).
    pub fn new(policy: RetryPolicy) -> Self {
        Self { policy }
    }

    /// What the middleware has done so far.
    pub fn stats(&self) -> RetryStats {
        self.policy.stats()
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> Result<Response> {
        let policy = &self.policy;
        let mut attempts = policy.begin(request.method(), request.url().path(), request.headers());
        let mut request = request;
        loop {
            let copy = attempts.as_ref().and_then(|_| request.try_clone());
            let replayable = attempts.as_mut().filter(|_| copy.is_some());
            let result = next.clone().run(request, extensions).await;
            let step = match &result {
                Ok(response) => policy.after_response(
                    replayable,
                    response.status(),
                    response.headers(),
                    response.extensions().get::<GaveUp>().is_some(),
                ),
                Err(_) => policy.after_error(replayable),
            };
            match (step, copy) {
                (Step::Retry(wait), Some(copy)) => {
                    tokio::time::sleep(wait).await;
                    request = copy;
                }
                (Step::GiveUp(reason), _) => {
                    let made = attempts.as_ref().map_or(1, |a| a.made());
                    return result.map(|mut response| {
                        if response.extensions().get::<GaveUp>().is_none() {
                            response.extensions_mut().insert(GaveUp {
                                reason,
                                attempts: made,
                            });
                        }
                        response
                    });
                }
                _ => return result,
            }
        }
    }
}
