//! Why the shedder sheds a request, and the metrics it keeps of it.

use super::classify::Criticality;
use crate::telemetry::{Counter, Gauge, Histogram};

/// Why a request was shed: the `reason` label of `tollgate_shed_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// No room for its class (and no queue to wait in).
    Capacity,
    /// The operator's signal said the service is busy.
    Utilization,
    /// Its tenant has its fair share.
    Unfair,
    /// The queue is full.
    QueueFull,
    /// Its client's deadline leaves no time to wait.
    Deadline,
    /// It waited in the queue, and its wait ran out.
    TimedOut,
}

impl Reason {
    const ALL: [Reason; 6] = [
        Reason::Capacity,
        Reason::Utilization,
        Reason::Unfair,
        Reason::QueueFull,
        Reason::Deadline,
        Reason::TimedOut,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Reason::Capacity => "capacity",
            Reason::Utilization => "utilization",
            Reason::Unfair => "unfair",
            Reason::QueueFull => "queue_full",
            Reason::Deadline => "deadline",
            Reason::TimedOut => "timed_out",
        }
    }
}

/// A request shed: its class, and why.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shed {
    pub(crate) class: Criticality,
    pub(crate) reason: Reason,
}

/// The shedder's metrics, registered when it is built.
pub(super) struct Telemetry {
    pub(super) in_flight: Gauge,
    pub(super) limit: Gauge,
    pub(super) queue: Histogram,
    /// By class, then by [`Reason`] (those the layer's settings cannot give count nothing).
    pub(super) shed: [[Counter; 6]; 4],
}

impl Telemetry {
    /// The metrics of a layer named `layer`, with an operator's signal or not, fairness or
    /// not, and a queue (with deadlines or not) or not.
    pub(super) fn new(layer: &str, utilization: bool, fair: bool, queue: Option<bool>) -> Self {
        use crate::metrics::{IN_FLIGHT, QUEUE_DURATION_SECONDS, SHED_LIMIT, SHED_TOTAL};
        let possible = |reason| match reason {
            Reason::Capacity => true,
            Reason::Utilization => utilization,
            Reason::Unfair => fair,
            Reason::QueueFull | Reason::TimedOut => queue.is_some(),
            Reason::Deadline => queue == Some(true),
        };
        Telemetry {
            in_flight: Gauge::new(IN_FLIGHT, &[("layer", layer)]),
            limit: Gauge::new(SHED_LIMIT, &[("layer", layer)]),
            queue: Histogram::new(QUEUE_DURATION_SECONDS, &[("layer", layer)]),
            shed: Criticality::ALL.map(|class| {
                Reason::ALL.map(|reason| {
                    if possible(reason) {
                        Counter::new(
                            SHED_TOTAL,
                            &[
                                ("layer", layer),
                                ("class", class.as_str()),
                                ("reason", reason.as_str()),
                            ],
                        )
                    } else {
                        Counter::noop()
                    }
                })
            }),
        }
    }
}
