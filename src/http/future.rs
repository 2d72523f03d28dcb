//! The response future: a state machine over the store's answer and the inner service's.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Shared;
use super::response::{FieldValues, HeaderProfile, Rejection, RejectionKind};
use crate::limiter::{Applied, NoKey, Plan, ShadowRejection};
use crate::{Decision, Store, StoreError};

type Planned = crate::limiter::Planned;
type ShadowPlan = Box<SmallVec<[Planned; 2]>>;

/// What an admitted request needs to reach the inner service.
pub(crate) struct Pending<S, B> {
    parts: Parts,
    body: B,
    inner: S,
}

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    ///
    /// With the in-process store it is never boxed and never waits: the store's future is
    /// ready, so the first poll moves on to the inner service's future. Only a tier lookup
    /// that misses the cache boxes (the resolver's future).
    pub struct ResponseFuture<S, St, B>
    where
        S: Service<Request<B>>,
        St: Store,
    {
        #[pin]
        state: State<St::Future, S::Future, Pending<S, B>>,
        shared: Arc<Shared<St>>,
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
            shadow: SmallVec<[Applied; 2]>,
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
    State<<St as Store>::Future, <S as Service<Request<B>>>::Future, Pending<S, B>>;

impl<S, St, B, ResBody> ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    St: Store,
{
    /// Plans the request and asks the store: the decision is made here, in `call()`.
    #[inline]
    pub(crate) fn start(shared: Arc<Shared<St>>, inner: S, request: Request<B>) -> Self {
        let (parts, body) = request.into_parts();
        let pending = Pending { parts, body, inner };
        let state = match shared.limiter.plan(&pending.parts) {
            Ok(plan) => Self::check(&shared, plan, pending),
            Err(no_key) => State::Answered {
                response: Some(shared.no_key(&pending.parts, no_key)),
            },
        };
        Self { state, shared }
    }

    #[inline]
    fn check(shared: &Shared<St>, plan: Plan, pending: Pending<S, B>) -> StateOf<S, St, B> {
        let limiter = &shared.limiter;
        if let Some((shadow, i, answer)) = limiter.next_unresolved(&plan) {
            return State::Resolving {
                answer,
                at: (shadow, i),
                plan: Box::new(plan),
                pending,
            };
        }
        let Plan { enforced, shadow } = plan;
        let shadow = (!shadow.is_empty()).then(|| Box::new(shadow));
        if enforced.is_empty() {
            return Self::after_enforced(shared, None, SmallVec::new(), shadow, pending);
        }
        let applied = applied(&enforced);
        let check = limiter.store.check_all(&limiter.checks(&enforced));
        State::Checking {
            check,
            pending,
            applied,
            shadow,
        }
    }

    fn after_enforced(
        shared: &Shared<St>,
        decision: Option<Decision>,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
        pending: Pending<S, B>,
    ) -> StateOf<S, St, B> {
        match shadow {
            None => Self::call_inner(shared, decision, &applied, pending, None),
            Some(shadow) => {
                let limiter = &shared.limiter;
                let check = limiter.store.check_all(&limiter.checks(&shadow));
                State::Shadowing {
                    check,
                    pending,
                    applied,
                    decision,
                    shadow: applied_shadow(&shadow),
                }
            }
        }
    }

    #[inline]
    fn call_inner(
        shared: &Shared<St>,
        decision: Option<Decision>,
        applied: &[Applied],
        pending: Pending<S, B>,
        shadow: Option<ShadowRejection>,
    ) -> StateOf<S, St, B> {
        let Pending {
            mut parts,
            body,
            mut inner,
        } = pending;
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

fn applied(planned: &[Planned]) -> SmallVec<[Applied; 4]> {
    planned
        .iter()
        .map(|p| Applied {
            rule: p.rule,
            set: p.set.unwrap_or(0),
        })
        .collect()
}

fn applied_shadow(planned: &[Planned]) -> SmallVec<[Applied; 2]> {
    planned
        .iter()
        .map(|p| Applied {
            rule: p.rule,
            set: p.set.unwrap_or(0),
        })
        .collect()
}

impl<S, St, B, ResBody> Future for ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
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
                    match result {
                        Ok(d) if d.allowed() => {
                            Self::after_enforced(this.shared, Some(d), applied, shadow, pending)
                        }
                        Ok(d) => State::Answered {
                            response: Some(this.shared.limited(&pending.parts, &d, &applied)),
                        },
                        Err(e) => State::Answered {
                            response: Some(this.shared.unavailable(&pending.parts, &e)),
                        },
                    }
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
                    // A shadow rule never refuses, and a failing store changes nothing here.
                    let rejection = match result {
                        Ok(d) if !d.allowed() => {
                            Some(this.shared.limiter.shadow_rejected(&shadow, d))
                        }
                        _ => None,
                    };
                    Self::call_inner(this.shared, decision, &applied, pending, rejection)
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
                    this.shared
                        .limiter
                        .resolved(&mut plan, at.0, at.1, tier.as_deref());
                    Self::check(this.shared, *plan, pending)
                }
                StateProj::Answered { response } => match response.take() {
                    Some(response) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response.map(ResponseBody::full)));
                    }
                    None => panic!("ResponseFuture polled after completion"),
                },
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
        let (_, name) = self.limiter.locate(applied, decision.index())?;
        Some(FieldValues::new(
            self.profile,
            self.reset,
            decision,
            name,
            || self.policy_field(applied),
        ))
    }

    /// `RateLimit-Policy`: every policy of every rule that applied.
    fn policy_field(&self, applied: &[Applied]) -> Option<HeaderValue> {
        if let [one] = applied {
            return Some(self.limiter.set(one.rule, one.set).field_value.clone());
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
        let located = self.limiter.locate(applied, decision.index());
        let rejection = Rejection {
            kind: RejectionKind::Limited,
            parts,
            status: http::StatusCode::TOO_MANY_REQUESTS,
            decision: Some(*decision),
            rule: located.map(|(r, _)| r),
            policy: located.map(|(_, p)| &**p),
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
            retry_after: None,
            error: None,
        })
    }
}
