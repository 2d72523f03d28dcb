//! Envoy's rate limit service messages, the server and a client, generated from
//! `src/envoy/rls.proto` (wire-compatible with Envoy's own protos).
#![allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rustdoc::all
)]

include!("envoy.service.ratelimit.v3.rs");
