//! The response future: a state machine over the store's answer and the inner service's.

use std::any::Any;
use std::fmt;
use std::future::{Future, Ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker, ready};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Shared;
use super::response::{FieldValues, HeaderProfile, Rejection, RejectionKind};
use crate::limiter::{Applied, NoKey, Plan, ShadowPlan, ShadowRejection, Start};
use crate::{Decision, Store, StoreError};

/// What a request that waits for an answer (a store that is not in-process, a tier
/// resolver) keeps: the shared state, the request, and its own ready inner service.
pub(crate) struct Pending<S, B, St> {
    shared: Arc<Shared<St>>,
    parts: Parts,
    body: B,
    inner: S,
}

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    ///
    /// With a store whose future is `std::future::Ready` (the in-process [`MemoryStore`]) the
    /// decision is made inside `call()` and the inner service is called right there: this
    /// future is then just the inner service's future (or the ready refusal), with nothing
    /// boxed or cloned. With any other store it waits for the store's answer, holding the
    /// request and a ready clone of the inner service. A tier lookup that misses the cache
    /// boxes the resolver's future.
    ///
    /// [`MemoryStore`]: crate::MemoryStore
    pub struct ResponseFuture<S, St, B>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<St::Future, S::Future, Box<Pending<S, B, St>>>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateReplace]
    enum State<CF, SF, P> {
        // Waiting for a tier resolver (a cache miss).
        Resolving {
            answer: crate::limiter::Resolving,
            at: (bool, usize),
            plan: Box<Plan>,
            pending: P,
        },
        // Waiting for the store's decision on the enforced rules.
        Checking {
            #[pin]
            check: CF,
            pending: P,
            applied: SmallVec<[Applied; 4]>,
            shadow: Option<ShadowPlan>,
        },
        // Admitted; waiting for the store's decision on the shadow rules.
        Shadowing {
            #[pin]
            check: CF,
            pending: P,
            applied: SmallVec<[Applied; 4]>,
            decision: Option<Decision>,
            shadow: SmallVec<[Applied; 4]>,
        },
        // Admitted; waiting for the inner service.
        Calling {
            #[pin]
            fut: SF,
            fields: Option<FieldValues>,
        },
        // Refused; the answer is ready.
        Answered { response: Option<Response<Bytes>> },
        Done,
    }
}

type StateOf<S, St, B> =
    State<<St as Store>::Future, <S as Service<Request<B>>>::Future, Box<Pending<S, B, St>>>;

/// The ready inner service: borrowed from the service in `call()` (a clone takes its place if
/// the request must wait), or owned by a waiting future.
trait ReadyInner<S> {
    fn call<R>(self, request: R) -> S::Future
    where
        S: Service<R>;

    fn into_owned(self) -> S;
}

struct Borrowed<'a, S>(&'a mut S);

impl<S: Clone> ReadyInner<S> for Borrowed<'_, S> {
    #[inline]
    fn call<R>(self, request: R) -> S::Future
    where
        S: Service<R>,
    {
        self.0.call(request)
    }

    fn into_owned(self) -> S {
        // The ready service goes with the request; its clone waits for the next poll_ready.
        let clone = self.0.clone();
        std::mem::replace(self.0, clone)
    }
}

struct Owned<S>(S);

impl<S> ReadyInner<S> for Owned<S> {
    fn call<R>(mut self, request: R) -> S::Future
    where
        S: Service<R>,
    {
        self.0.call(request)
    }

    fn into_owned(self) -> S {
        self.0
    }
}

/// The output of a store future that is already known, or the future back.
#[inline]
fn now<F>(mut check: F) -> Result<Result<Decision, StoreError>, F>
where
    F: Future<Output = Result<Decision, StoreError>> + 'static,
{
    let any: &mut dyn Any = &mut check;
    if let Some(ready) = any.downcast_mut::<Ready<Result<Decision, StoreError>>>() {
        if let Poll::Ready(output) = Pin::new(ready).poll(&mut Context::from_waker(Waker::noop())) {
            return Ok(output);
        }
    }
    Err(check)
}

impl<S, St, B, ResBody> ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
{
    /// What `RateLimit::call` does: plans the request, asks the store, and with an
    /// in-process store decides and calls the inner service right here.
    #[inline(always)]
    pub(crate) fn call(shared: &Arc<Shared<St>>, inner: &mut S, request: Request<B>) -> Self {
        let (parts, body) = request.into_parts();
        let start = shared.limiter.start(&parts);
        Self {
            state: Self::started(shared, start, parts, body, Borrowed(inner)),
        }
    }

    #[inline(always)]
    fn started(
        shared: &Arc<Shared<St>>,
        start: Start<St::Future>,
        parts: Parts,
        body: B,
        inner: impl ReadyInner<S>,
    ) -> StateOf<S, St, B> {
        match start {
            Start::Checking {
                check,
                applied,
                shadow,
            } => match now(check) {
                Ok(result) => Self::decided(shared, result, applied, shadow, parts, body, inner),
                Err(check) => State::Checking {
                    check,
                    pending: Box::new(Pending {
                        shared: Arc::clone(shared),
                        parts,
                        body,
                        inner: inner.into_owned(),
                    }),
                    applied,
                    shadow,
                },
            },
            Start::Unchecked { shadow } => {
                Self::admitted(shared, None, SmallVec::new(), shadow, parts, body, inner)
            }
            Start::Resolving { plan, at, answer } => State::Resolving {
                answer,
                at,
                plan,
                pending: Box::new(Pending {
                    shared: Arc::clone(shared),
                    parts,
                    body,
                    inner: inner.into_owned(),
                }),
            },
            Start::NoKey(no_key) => State::Answered {
                response: Some(shared.no_key(&parts, no_key)),
            },
        }
    }

    /// The enforced rules' decision is known.
    #[inline(always)]
    fn decided(
        shared: &Arc<Shared<St>>,
        result: Result<Decision, StoreError>,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
        parts: Parts,
        body: B,
        inner: impl ReadyInner<S>,
    ) -> StateOf<S, St, B> {
        match result {
            Ok(d) if d.allowed() => {
                Self::admitted(shared, Some(d), applied, shadow, parts, body, inner)
            }
            Ok(d) => State::Answered {
                response: Some(shared.limited(&parts, &d, &applied)),
            },
            Err(e) => State::Answered {
                response: Some(shared.unavailable(&parts, &e)),
            },
        }
    }

    /// Admitted by the enforced rules: the shadow rules, then the inner service.
    #[inline(always)]
    fn admitted(
        shared: &Arc<Shared<St>>,
        decision: Option<Decision>,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
        parts: Parts,
        body: B,
        inner: impl ReadyInner<S>,
    ) -> StateOf<S, St, B> {
        let rejection = match shadow {
            None => None,
            Some(shadow) => {
                let (check, shadow) = shared.limiter.check_shadow(&shadow);
                match now(check) {
                    Ok(result) => shadow_rejection(shared, result, &shadow),
                    Err(check) => {
                        return State::Shadowing {
                            check,
                            pending: Box::new(Pending {
                                shared: Arc::clone(shared),
                                parts,
                                body,
                                inner: inner.into_owned(),
                            }),
                            applied,
                            decision,
                            shadow,
                        };
                    }
                }
            }
        };
        Self::call_inner(shared, decision, &applied, parts, body, inner, rejection)
    }

    #[inline(always)]
    fn call_inner(
        shared: &Shared<St>,
        decision: Option<Decision>,
        applied: &[Applied],
        mut parts: Parts,
        body: B,
        inner: impl ReadyInner<S>,
        shadow: Option<ShadowRejection>,
    ) -> StateOf<S, St, B> {
        let fields = match decision {
            Some(d) => {
                if shared.decision_extension {
                    parts.extensions.insert(d);
                }
                shared.fields(&d, applied)
            }
            None => None,
        };
        if let Some(shadow) = shadow {
            parts.extensions.insert(shadow);
        }
        State::Calling {
            fut: inner.call(Request::from_parts(parts, body)),
            fields,
        }
    }
}

/// A shadow rule's refusal, reported; anything else (an admission, a failing store) changes
/// nothing.
fn shadow_rejection<St: Store>(
    shared: &Shared<St>,
    result: Result<Decision, StoreError>,
    applied: &[Applied],
) -> Option<ShadowRejection> {
    match result {
        Ok(d) if !d.allowed() => Some(shared.limiter.shadow_rejected(applied, d)),
        _ => None,
    }
}

impl<S, St, B, ResBody> Future for ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Calling { fut, fields } => {
                    let response = ready!(fut.poll(cx))?;
                    let mut response = response.map(ResponseBody::inner);
                    if let Some(fields) = fields.take() {
                        fields.apply(response.headers_mut());
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Answered { response } => match response.take() {
                    Some(response) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response.map(ResponseBody::full)));
                    }
                    None => panic!("ResponseFuture polled after completion"),
                },
                StateProj::Checking { check, .. } => {
                    let result = ready!(check.poll(cx));
                    let StateReplace::Checking {
                        pending,
                        applied,
                        shadow,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let Pending {
                        shared,
                        parts,
                        body,
                        inner,
                    } = *pending;
                    Self::decided(&shared, result, applied, shadow, parts, body, Owned(inner))
                }
                StateProj::Shadowing { check, .. } => {
                    let result = ready!(check.poll(cx));
                    let StateReplace::Shadowing {
                        pending,
                        applied,
                        decision,
                        shadow,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let Pending {
                        shared,
                        parts,
                        body,
                        inner,
                    } = *pending;
                    let rejection = shadow_rejection(&shared, result, &shadow);
                    Self::call_inner(
                        &shared,
                        decision,
                        &applied,
                        parts,
                        body,
                        Owned(inner),
                        rejection,
                    )
                }
                StateProj::Resolving { answer, .. } => {
                    let tier = ready!(answer.as_mut().poll(cx));
                    let StateReplace::Resolving {
                        at,
                        mut plan,
                        pending,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let Pending {
                        shared,
                        parts,
                        body,
                        inner,
                    } = *pending;
                    let limiter = &shared.limiter;
                    limiter.resolved(&mut plan, at.0, at.1, tier.as_deref());
                    let start = limiter.resume(plan);
                    Self::started(&shared, start, parts, body, Owned(inner))
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            this.state.set(next);
        }
    }
}

impl<S, St, B> fmt::Debug for ResponseFuture<S, St, B>
where
    S: Service<Request<B>>,
    St: Store,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<St: Store> Shared<St> {
    /// The rate-limit fields of an admitted request.
    #[inline]
    fn fields(&self, decision: &Decision, applied: &[Applied]) -> Option<FieldValues> {
        if self.profile == HeaderProfile::Off {
            return None;
        }
        let item = self.limiter.item(applied, decision.index())?;
        Some(FieldValues::new(
            self.profile,
            self.reset,
            decision,
            item,
            || self.policy_field(applied),
        ))
    }

    /// `RateLimit-Policy`: every policy of every rule that applied.
    fn policy_field(&self, applied: &[Applied]) -> Option<HeaderValue> {
        if let [one] = applied {
            return Some(self.limiter.set(one.rule, one.set).field_value.clone());
        }
        if let Some(all) = &self.all_policies {
            let every_rule_first_set = applied.len() == self.limiter.rules.len()
                && applied
                    .iter()
                    .enumerate()
                    .all(|(i, a)| usize::from(a.rule) == i && a.set == 0);
            if every_rule_first_set {
                return Some(all.clone());
            }
        }
        let mut joined = String::new();
        for a in applied {
            if !joined.is_empty() {
                joined.push_str(", ");
            }
            joined.push_str(&self.limiter.set(a.rule, a.set).field);
        }
        HeaderValue::from_str(&joined).ok()
    }

    /// The answer to a request a policy refused.
    fn limited(&self, parts: &Parts, decision: &Decision, applied: &[Applied]) -> Response<Bytes> {
        let located = self.limiter.locate_policy(applied, decision.index());
        let rejection = Rejection {
            kind: RejectionKind::Limited,
            parts,
            status: http::StatusCode::TOO_MANY_REQUESTS,
            decision: Some(*decision),
            rule: located.map(|(r, _, _)| r),
            policy: located.map(|(_, p, _)| &**p),
            window: located.map(|(_, _, p)| p.window()),
            retry_after: decision.retry_after(),
            error: None,
        };
        let mut response = self.responder.respond(&rejection);
        if let Some(fields) = self.fields(decision, applied) {
            fields.apply(response.headers_mut());
        }
        response
    }

    /// The answer when the store could not decide.
    fn unavailable(&self, parts: &Parts, error: &StoreError) -> Response<Bytes> {
        self.responder.respond(&Rejection {
            kind: RejectionKind::Unavailable,
            parts,
            status: http::StatusCode::SERVICE_UNAVAILABLE,
            decision: None,
            rule: None,
            policy: None,
            window: None,
            retry_after: Some(self.unavailable_retry_after),
            error: Some(error),
        })
    }

    /// The answer to a request a rule found no key for.
    fn no_key(&self, parts: &Parts, no_key: NoKey) -> Response<Bytes> {
        let rule = self
            .limiter
            .rules
            .get(usize::from(no_key.rule))
            .map(|r| &*r.name);
        self.responder.respond(&Rejection {
            kind: RejectionKind::NoKey,
            parts,
            status: no_key.status,
            decision: None,
            rule,
            policy: None,
            window: None,
            retry_after: None,
            error: None,
        })
    }
}
