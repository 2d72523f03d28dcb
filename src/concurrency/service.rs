//! The service: a permit per request, or an answer.

use super::layer::Shared;
use crate::inflight::in_flight_service;

in_flight_service! {
    /// The service made by [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer). Clones
    /// share the layer's counts.
    ConcurrencyLimit,
    |shared, parts| admit: shared.admit(parts),
    refuse: |parts, refusal| shared.answer(parts, refusal),
}
