//! The Prometheus recorder the example servers share (`examples/server`, `envoy_rls`): one per
//! process, installed before any layer, store or service is built, with the units and
//! descriptions of every tollgate metric (`# HELP` lines).

use std::error::Error;
use std::sync::Mutex;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// The metrics recorder (one per process; later calls return the same handle).
pub fn prometheus() -> Result<PrometheusHandle, Box<dyn Error>> {
    static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);
    let mut installed = HANDLE
        .lock()
        .map_err(|_| "a test panicked while installing")?;
    if let Some(handle) = &*installed {
        return Ok(handle.clone());
    }
    // Durations as histograms (buckets from 100 us to 10 s), so that dashboards can take
    // quantiles over many instances.
    let buckets = [
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        10.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &buckets)?
        .install_recorder()?;
    // Units and descriptions: the `# HELP` lines.
    tollgate::metrics::describe();
    *installed = Some(handle.clone());
    Ok(handle)
}
