//! Envoy's rate limit service.
pub mod proto;
