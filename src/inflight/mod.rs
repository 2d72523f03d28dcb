//! What the in-flight layers ([`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer),
//! [`LoadShedLayer`](crate::LoadShedLayer)) share: a request admitted holds a place until its
//! response body ends, and one call path, future and body serve both layers.

mod body;
mod future;

pub use body::PermitBody;
pub use future::ResponseFuture;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response};
use tower_service::Service;

use crate::answer::RefusalBody;

/// A place an admitted request holds until its response body ends; dropping it gives the place
/// back.
// Boxing the permit would allocate on every request; it lives in the response body.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Held {
    /// Held for what its `Drop` gives back.
    Concurrency(#[allow(dead_code)] crate::concurrency::Permit),
    Shed(crate::shed::Guard),
}

/// A request's wait for a place (a lease on Redis, a queue): its place, or how to answer it.
pub(crate) type Pending =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Held, Refuse>> + Send>>;

/// How to answer a request that waited and got no place.
pub(crate) type Refuse = Box<dyn FnOnce(&Parts) -> Response<Bytes> + Send>;

/// A request admitted: with its place now, or once it has waited for one.
// `Now` is the path of every request that does not wait: boxing it would allocate on each.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Admitted {
    Now(Held),
    Later(Pending),
}

impl From<Held> for Admitted {
    fn from(held: Held) -> Self {
        Admitted::Now(held)
    }
}

/// How the inner service answered, as the shedder learns from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The service's own answer; `failed` when it was an error, a 503 or a 504 (overload).
    Served { failed: bool },
    /// A tollgate layer inside refused it ([`Refused`](crate::answer::Refused)): its time says
    /// nothing about the service.
    Refused,
    /// A client error (a 4xx, or gRPC's `INVALID_ARGUMENT`, `NOT_FOUND`, `PERMISSION_DENIED`
    /// or `UNAUTHENTICATED` in a 200's head): the request asked for nothing the service had to
    /// work for, so its time says nothing about the service either (a scanner's 404s would
    /// otherwise read as a service that got faster).
    ClientError,
}

impl Held {
    /// Whether the inner service's answer teaches anything: to a shedder that times its
    /// requests (a concurrency permit, or a fixed shedder without deadlines, learns nothing,
    /// and the answer need not be read).
    pub(crate) fn learns(&self) -> bool {
        matches!(self, Held::Shed(guard) if guard.learns())
    }

    /// The inner service answered: the shedder learns from it.
    pub(crate) fn answered(&mut self, answer: Answer) {
        if let Held::Shed(guard) = self {
            guard.answered(answer);
        }
    }
}

/// One `call` of a layer that admits a request into `inner` holding a place (at once, or
/// after a wait), or refuses it and answers: the ready service moves into the future and a
/// clone stays for the next call.
pub(crate) fn call<S, ReqBody, ResBody, R>(
    inner: &mut S,
    request: Request<ReqBody>,
    admit: impl FnOnce(&Parts) -> Result<Admitted, R>,
    answer: impl FnOnce(&Parts, R) -> Response<Bytes>,
) -> ResponseFuture<S, ReqBody, ResBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    ResBody: RefusalBody,
{
    let (parts, body) = request.into_parts();
    match admit(&parts) {
        Ok(admitted) => {
            let request = Request::from_parts(parts, body);
            match admitted {
                Admitted::Now(held) => {
                    let clone = inner.clone();
                    let mut ready = std::mem::replace(inner, clone);
                    // Should `call` panic, `held` is dropped on the way out: nothing leaks.
                    ResponseFuture::called(ready.call(request), held)
                }
                // `inner` stays ready for the next call; the waiter makes its own clone ready.
                Admitted::Later(pending) => {
                    ResponseFuture::waiting(pending, request, inner.clone())
                }
            }
        }
        Err(refusal) => ResponseFuture::refused(answer(&parts, refusal).map(ResBody::refusal)),
    }
}

/// The service of an in-flight layer: the inner service and the layer's shared state, with
/// `call` admitting through `$admit` (a place, [`Held`]) or answering through `$refuse`. Both
/// layers' services are this one shape, written once.
macro_rules! in_flight_service {
    (
        $(#[$doc:meta])*
        $name:ident,
        |$shared:ident, $parts:ident| admit: $admit:expr,
        refuse: |$rparts:ident, $refusal:ident| $refuse:expr $(,)?
    ) => {
        $(#[$doc])*
        pub struct $name<S> {
            inner: S,
            shared: std::sync::Arc<Shared>,
        }

        impl<S> $name<S> {
            pub(crate) fn new(inner: S, shared: std::sync::Arc<Shared>) -> Self {
                Self { inner, shared }
            }

            /// The inner service.
            pub fn get_ref(&self) -> &S {
                &self.inner
            }
        }

        impl<S: Clone> Clone for $name<S> {
            fn clone(&self) -> Self {
                Self {
                    inner: self.inner.clone(),
                    shared: self.shared.clone(),
                }
            }
        }

        impl<S: std::fmt::Debug> std::fmt::Debug for $name<S> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("inner", &self.inner)
                    .finish_non_exhaustive()
            }
        }

        impl<S, ReqBody, ResBody> tower_service::Service<http::Request<ReqBody>> for $name<S>
        where
            S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
                + Clone,
            ResBody: $crate::answer::RefusalBody,
        {
            type Response = http::Response<$crate::inflight::PermitBody<ResBody>>;
            type Error = S::Error;
            type Future = $crate::inflight::ResponseFuture<S, ReqBody, ResBody>;

            fn poll_ready(
                &mut self,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Result<(), Self::Error>> {
                self.inner.poll_ready(cx)
            }

            fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
                let $shared = &self.shared;
                $crate::inflight::call(
                    &mut self.inner,
                    request,
                    |$parts| $admit.map(Into::into),
                    |$rparts, $refusal| $refuse,
                )
            }
        }
    };
}

pub(crate) use in_flight_service;
