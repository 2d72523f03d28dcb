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

use super::layer::Shared;
use crate::answer::RefusalBody;
use crate::answer::{FieldValues, HeaderProfile, Rejection, RejectionKind};
use crate::limiter::{
    Applied, Costly, NoKey, Plan, ShadowCheck, ShadowPlan, ShadowRejection, Single, Start,
};
use crate::telemetry::DecisionSpan;
use crate::{Decision, Store, StoreError};

/// What a request that waits for an answer (a store that is not in-process, a tier
/// resolver) keeps: the shared state, the request, and its own ready inner service.
pub(crate) struct Pending<S, B, St> {
    shared: Arc<Shared<St>>,
    parts: Parts,
    body: B,
    inner: S,
    /// The decision's span (nothing without the `tracing` feature).
    span: DecisionSpan,
}

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    ///
    /// With a store whose future is `std::future::Ready` (the in-process [`MemoryStore`]) the
    /// decision is made inside `call()` and the inner service is called right there: this
    /// future is then just the inner service's future (or the ready refusal), with nothing
    /// boxed or cloned. With any other store it waits for the store's answer, holding the
    /// request and a ready clone of the inner service. A tier lookup that misses the cache
    /// boxes the lookup's future (which asks the resolver, or waits for the lookup of the same
    /// key under way).
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
        // Waiting for a tier resolver (a cache miss of an enforced rule).
        Resolving {
            answer: crate::limiter::TierOf,
            at: usize,
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

/// What happens next to a request, decided from its head alone (borrowed, so that the head
/// moves once, into the inner service's request or into [`Pending`]).
enum Next<F> {
    /// Admitted: call the inner service, then add these fields to its response.
    Call(Option<FieldValues>),
    /// Refused: this is the answer.
    Answer(Response<Bytes>),
    /// Wait for the store's decision on the enforced rules.
    Check {
        check: F,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
    },
    /// Admitted; wait for the store's decision on the shadow rules.
    Shadow {
        check: F,
        applied: SmallVec<[Applied; 4]>,
        decision: Option<Decision>,
        shadow: SmallVec<[Applied; 4]>,
    },
    /// Wait for a tier resolver.
    Resolve {
        plan: Box<Plan>,
        at: usize,
        answer: crate::limiter::TierOf,
    },
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
    // The store of a configuration file, when it is the in-process one.
    #[cfg(feature = "serde")]
    if let Some(configured) = any.downcast_mut::<crate::config::ConfiguredFuture>() {
        if let Some(output) = configured.now() {
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
    /// in-process store decides and calls the (ready) inner service right here.
    #[inline(always)]
    pub(crate) fn call(shared: &Arc<Shared<St>>, inner: &mut S, request: Request<B>) -> Self {
        let (mut parts, body) = request.into_parts();
        let span = DecisionSpan::new();
        let next = span.in_scope(|| shared.start(&mut parts, &span));
        let state = match next {
            Next::Call(fields) => State::Calling {
                fut: inner.call(Request::from_parts(parts, body)),
                fields,
            },
            Next::Answer(response) => State::Answered {
                response: Some(response),
            },
            next => {
                // The ready service goes with the request; its clone waits for the next
                // poll_ready.
                let clone = inner.clone();
                let pending = Box::new(Pending {
                    shared: Arc::clone(shared),
                    parts,
                    body,
                    inner: std::mem::replace(inner, clone),
                    span,
                });
                Self::then(next, pending)
            }
        };
        Self { state }
    }

    /// The state in which a waiting request goes on.
    fn then(next: Next<St::Future>, pending: Box<Pending<S, B, St>>) -> StateOf<S, St, B> {
        match next {
            Next::Call(fields) => {
                let Pending {
                    parts,
                    body,
                    mut inner,
                    ..
                } = *pending;
                State::Calling {
                    fut: inner.call(Request::from_parts(parts, body)),
                    fields,
                }
            }
            Next::Answer(response) => State::Answered {
                response: Some(response),
            },
            Next::Check {
                check,
                applied,
                shadow,
            } => State::Checking {
                check,
                pending,
                applied,
                shadow,
            },
            Next::Shadow {
                check,
                applied,
                decision,
                shadow,
            } => State::Shadowing {
                check,
                pending,
                applied,
                decision,
                shadow,
            },
            Next::Resolve { plan, at, answer } => State::Resolving {
                answer,
                at,
                plan,
                pending,
            },
        }
    }
}

impl<S, St, B, ResBody> Future for ResponseFuture<S, St, B>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    St: Store,
    ResBody: RefusalBody,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Calling { fut, fields } => {
                    let mut response = ready!(fut.poll(cx))?;
                    if let Some(fields) = fields.take() {
                        fields.apply(response.headers_mut());
                    }
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Answered { response } => match response.take() {
                    Some(response) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response.map(ResBody::refusal)));
                    }
                    None => panic!("ResponseFuture polled after completion"),
                },
                StateProj::Checking { check, pending, .. } => {
                    let result = ready!(pending.span.in_scope(|| check.poll(cx)));
                    let StateReplace::Checking {
                        mut pending,
                        applied,
                        shadow,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let p = &mut *pending;
                    let next = p
                        .shared
                        .decided(result, applied, shadow, &mut p.parts, &p.span);
                    Self::then(next, pending)
                }
                StateProj::Shadowing { check, pending, .. } => {
                    let result = ready!(pending.span.in_scope(|| check.poll(cx)));
                    let StateReplace::Shadowing {
                        mut pending,
                        applied,
                        decision,
                        shadow,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let p = &mut *pending;
                    let rejection = p.shared.shadow_rejection(result, &shadow, &p.span);
                    let fields = p.shared.admit(decision, &applied, &mut p.parts, rejection);
                    Self::then(Next::Call(fields), pending)
                }
                StateProj::Resolving {
                    answer, pending, ..
                } => {
                    let tier = ready!(pending.span.in_scope(|| answer.as_mut().poll(cx)));
                    let StateReplace::Resolving {
                        at,
                        mut plan,
                        mut pending,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was just matched")
                    };
                    let p = &mut *pending;
                    let limiter = &p.shared.limiter;
                    plan.resolved(at, tier);
                    let next = p.span.in_scope(|| {
                        let start = limiter.resume(plan, &p.span);
                        p.shared.started(start, &mut p.parts, &p.span)
                    });
                    Self::then(next, pending)
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
    /// Plans the request and asks the store; with an in-process store, decides.
    #[inline(always)]
    fn start(&self, parts: &mut Parts, span: &DecisionSpan) -> Next<St::Future> {
        if self.limiter.is_single() {
            return self.start_single(parts, span);
        }
        let start = self.limiter.start(parts, span);
        self.started(start, parts, span)
    }

    /// [`Shared::start`] for the one rule with one policy of a `single` limiter: the same
    /// answers, without the list of applied rules, when the store answers at once.
    #[inline(always)]
    fn start_single(&self, parts: &mut Parts, span: &DecisionSpan) -> Next<St::Future> {
        let (check, applied) = match self.limiter.check_single(parts, span) {
            Single::Checked { check, applied } => (check, applied),
            Single::Skip => {
                span.record("unchecked", None, None, None);
                return Next::Call(None);
            }
            Single::NoKey(no_key) => {
                self.limiter.observe_no_key(no_key, span);
                return Next::Answer(self.no_key(parts, no_key));
            }
            Single::Costly { costly, applied } => {
                return Next::Answer(self.costly(
                    parts,
                    costly,
                    std::slice::from_ref(&applied),
                    span,
                ));
            }
        };
        let result = match now(check) {
            Ok(result) => result,
            Err(check) => {
                let mut list = SmallVec::new();
                list.push(applied);
                return Next::Check {
                    check,
                    applied: list,
                    shadow: None,
                };
            }
        };
        if let Err(StoreError::CostExceedsLimit { index, limit, .. }) = result {
            let costly = Costly { index, limit };
            let applied = std::slice::from_ref(&applied);
            return Next::Answer(self.costly(parts, costly, applied, span));
        }
        self.limiter.observe_single(&applied, &result, span);
        match result {
            Ok(d) if d.allowed() => {
                if self.decision_extension {
                    parts.extensions.insert(d);
                }
                Next::Call(self.single_fields(&d))
            }
            Ok(d) => Next::Answer(self.limited(parts, &d, std::slice::from_ref(&applied))),
            Err(e) => Next::Answer(self.unavailable(parts, &e)),
        }
    }

    /// [`Shared::fields`] for the one policy of a `single` limiter.
    #[inline(always)]
    fn single_fields(&self, decision: &Decision) -> Option<FieldValues> {
        if self.profile == HeaderProfile::Off {
            return None;
        }
        let (_, set, policy) = self.limiter.single()?;
        Some(FieldValues::new(
            self.profile,
            self.reset,
            decision,
            policy,
            set.statuses.first()?,
            || Some(set.field_value.clone()),
        ))
    }

    /// Where a request stands once its rules are planned and the store asked.
    #[inline(always)]
    fn started(
        &self,
        start: Start<St::Future>,
        parts: &mut Parts,
        span: &DecisionSpan,
    ) -> Next<St::Future> {
        match start {
            Start::Checking {
                check,
                applied,
                shadow,
            } => match now(check) {
                Ok(result) => self.decided(result, applied, shadow, parts, span),
                Err(check) => Next::Check {
                    check,
                    applied,
                    shadow,
                },
            },
            Start::Unchecked { shadow } => {
                span.record("unchecked", None, None, None);
                self.admitted(None, SmallVec::new(), shadow, parts, span)
            }
            Start::Resolving { plan, at, answer } => Next::Resolve { plan, at, answer },
            Start::NoKey(no_key) => {
                self.limiter.observe_no_key(no_key, span);
                Next::Answer(self.no_key(parts, no_key))
            }
            Start::Costly { costly, applied } => {
                Next::Answer(self.costly(parts, costly, &applied, span))
            }
        }
    }

    /// The enforced rules' decision is known.
    #[inline(always)]
    fn decided(
        &self,
        result: Result<Decision, StoreError>,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
        parts: &mut Parts,
        span: &DecisionSpan,
    ) -> Next<St::Future> {
        // A store that finds a cost it can never admit: a refusal, never a failure (which a
        // failure policy could turn into an admission).
        if let Err(StoreError::CostExceedsLimit { index, limit, .. }) = result {
            return Next::Answer(self.costly(parts, Costly { index, limit }, &applied, span));
        }
        self.limiter.observe(&applied, &result, span);
        match result {
            Ok(d) if d.allowed() => self.admitted(Some(d), applied, shadow, parts, span),
            Ok(d) => Next::Answer(self.limited(parts, &d, &applied)),
            Err(e) => Next::Answer(self.unavailable(parts, &e)),
        }
    }

    /// Admitted by the enforced rules: the shadow rules, then the inner service.
    #[inline(always)]
    fn admitted(
        &self,
        decision: Option<Decision>,
        applied: SmallVec<[Applied; 4]>,
        shadow: Option<ShadowPlan>,
        parts: &mut Parts,
        span: &DecisionSpan,
    ) -> Next<St::Future> {
        let rejection = match shadow {
            None => None,
            Some(mut shadow) => match self.limiter.check_shadow(&mut shadow) {
                ShadowCheck::Nothing => None,
                ShadowCheck::Costly(costly, shadow) => {
                    self.shadow_rejection(Ok(costly.decision()), &shadow, span)
                }
                ShadowCheck::Checking(check, shadow) => match now(check) {
                    Ok(result) => self.shadow_rejection(result, &shadow, span),
                    Err(check) => {
                        return Next::Shadow {
                            check,
                            applied,
                            decision,
                            shadow,
                        };
                    }
                },
            },
        };
        Next::Call(self.admit(decision, &applied, parts, rejection))
    }

    /// The request's extensions and response fields, on its way to the inner service.
    #[inline(always)]
    fn admit(
        &self,
        decision: Option<Decision>,
        applied: &[Applied],
        parts: &mut Parts,
        shadow: Option<ShadowRejection>,
    ) -> Option<FieldValues> {
        if let Some(shadow) = shadow {
            parts.extensions.insert(shadow);
        }
        let d = decision?;
        if self.decision_extension {
            parts.extensions.insert(d);
        }
        self.fields(&d, applied)
    }

    /// A shadow rule's refusal, reported; anything else (an admission, a failing store)
    /// changes nothing.
    fn shadow_rejection(
        &self,
        result: Result<Decision, StoreError>,
        applied: &[Applied],
        span: &DecisionSpan,
    ) -> Option<ShadowRejection> {
        let result = match result {
            Err(StoreError::CostExceedsLimit { index, limit, .. }) => {
                Ok(Costly { index, limit }.decision())
            }
            result => result,
        };
        self.limiter.observe_shadow(applied, &result, span);
        match result {
            Ok(d) if !d.allowed() => Some(self.limiter.shadow_rejected(applied, d)),
            _ => None,
        }
    }

    /// The rate-limit fields of an admitted request.
    #[inline(always)]
    fn fields(&self, decision: &Decision, applied: &[Applied]) -> Option<FieldValues> {
        if self.profile == HeaderProfile::Off {
            return None;
        }
        let (policy, status) = self.limiter.status(applied, decision.index())?;
        Some(FieldValues::new(
            self.profile,
            self.reset,
            decision,
            policy,
            status,
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
            window: located.map(|(_, _, p)| crate::answer::PolicySpan::from(p)),
            retry_after: decision.retry_after(),
            error: None,
        };
        let mut response = crate::answer::refuse(&*self.responder, &rejection);
        if let Some(fields) = self.fields(decision, applied) {
            fields.apply(response.headers_mut());
        }
        response
    }

    /// The answer to a request that costs more than one of its policies' limit: refused as
    /// over that limit, with no time to come back at (none would do), without asking the
    /// store.
    #[cold]
    fn costly(
        &self,
        parts: &Parts,
        costly: Costly,
        applied: &[Applied],
        span: &DecisionSpan,
    ) -> Response<Bytes> {
        self.limiter.observe_costly(applied, costly, span);
        let located = self.limiter.locate_policy(applied, costly.index);
        let mut response = crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind: RejectionKind::Limited,
                parts,
                status: http::StatusCode::TOO_MANY_REQUESTS,
                decision: None,
                rule: located.map(|(r, _, _)| r),
                policy: located.map(|(_, p, _)| &**p),
                window: located.map(|(_, _, p)| crate::answer::PolicySpan::from(p)),
                retry_after: None,
                error: None,
            },
        );
        // The quotas, so that the client sees its request cannot fit; no `RateLimit`: there
        // is no time at which it would.
        if matches!(self.profile, HeaderProfile::Ietf | HeaderProfile::Both) {
            if let Some(policies) = self.policy_field(applied) {
                response
                    .headers_mut()
                    .insert(crate::answer::RATELIMIT_POLICY, policies);
            }
        }
        response
    }

    /// The answer when the store could not decide.
    fn unavailable(&self, parts: &Parts, error: &StoreError) -> Response<Bytes> {
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind: RejectionKind::Unavailable,
                parts,
                status: http::StatusCode::SERVICE_UNAVAILABLE,
                decision: None,
                rule: None,
                policy: None,
                window: None,
                retry_after: Some(self.unavailable_retry_after),
                error: Some(error),
            },
        )
    }

    /// The answer to a request a rule found no key for.
    fn no_key(&self, parts: &Parts, no_key: NoKey) -> Response<Bytes> {
        let rule = self
            .limiter
            .rules
            .get(usize::from(no_key.rule))
            .map(|r| &*r.name);
        crate::answer::refuse(
            &*self.responder,
            &Rejection {
                kind: RejectionKind::NoKey,
                parts,
                status: no_key.status,
                decision: None,
                rule,
                policy: None,
                window: None,
                retry_after: None,
                error: None,
            },
        )
    }
}
