//! The service: a permit per request, or an answer.

use super::layer::Shared;
use crate::inflight::{Held, in_flight_service};

in_flight_service! {
    /// The service made by [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer). Clones
    /// share the layer's counts.
    ConcurrencyLimit,
    |shared, parts| admit: shared.admit(parts).map(Held::Concurrency),
    refuse: |parts, refusal| shared.answer(parts, refusal),
}
