//! The service: admitted, or shed before the inner service is called.

use super::layer::Shared;
use crate::inflight::in_flight_service;

in_flight_service! {
    /// The service made by [`LoadShedLayer`](super::LoadShedLayer). Clones share the layer's
    /// limit and counts.
    LoadShed,
    |shared, parts| admit: shared.admit(parts),
    refuse: |parts, shed| shared.refuse(parts, shed),
}
