//! The `[shed]` section: the load shedder.

use http::HeaderName;

use super::Builder;
use super::{label_ok, queue_ok};
use crate::LoadShedLayer;
use crate::config::schema::*;
use crate::shed::{ByHeader, Criticality, Limit};

impl<'a> Builder<'a> {
    /// The load shedder, if the file has one.
    pub(crate) fn shed(&mut self) -> Option<LoadShedLayer> {
        let spec = self.config.shed.as_ref()?;
        let p = &mut self.problems;
        let adaptive = spec.limit != ShedLimitKind::Fixed;
        if spec.initial == 0 {
            p.add("shed.initial", "must be at least 1");
        }
        if !adaptive {
            for (field, set) in [("min", spec.min.is_some()), ("max", spec.max.is_some())] {
                if set {
                    p.add(format!("shed.{field}"), "only for an adaptive limit");
                }
            }
        }
        if adaptive {
            let (min, max) = (spec.min.unwrap_or(1), spec.max.unwrap_or(1_000));
            if spec.min == Some(0) {
                p.add("shed.min", "must be at least 1");
            }
            if min > max {
                p.add("shed.min", format!("{min} is above max ({max})"));
            } else if !(min..=max).contains(&spec.initial) && spec.initial > 0 {
                p.add(
                    "shed.initial",
                    format!(
                        "{}: give a value within min ({min}) and max ({max})",
                        spec.initial
                    ),
                );
            }
        }
        let mut limit = match spec.limit {
            ShedLimitKind::Fixed => Limit::fixed(spec.initial),
            ShedLimitKind::Vegas => Limit::vegas(spec.initial),
            ShedLimitKind::Aimd => match spec.latency {
                Some(latency) if !latency.get().is_zero() => {
                    Limit::aimd(spec.initial, latency.get())
                }
                Some(_) => {
                    p.add("shed.latency", "must be above zero");
                    return None;
                }
                None => {
                    p.add("shed.latency", "missing: the AIMD limit's latency target");
                    return None;
                }
            },
        };
        if spec.latency.is_some() && spec.limit != ShedLimitKind::Aimd {
            p.add("shed.latency", "only for limit = \"aimd\"");
        }
        if adaptive {
            limit = limit.bounds(spec.min.unwrap_or(1), spec.max.unwrap_or(1_000));
        }
        let mut builder = LoadShedLayer::builder(limit);
        if let Some(name) = &spec.name {
            label_ok(name, "shed.name", p);
            builder = builder.name(name.as_str());
        }
        if let Some(name) = &spec.class_header {
            match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => builder = builder.classify(ByHeader::new(name)),
                Err(_) => p.add("shed.class_header", format!("not a header name: {name:?}")),
            }
        }
        for (class, share) in &spec.shares {
            match class.parse::<Criticality>() {
                Ok(c) if share.is_finite() && (0.001..=1.0).contains(share) => {
                    builder = builder.share(c, *share);
                }
                Ok(_) => p.add(
                    format!("shed.shares.{class}"),
                    format!("{share}: give 0.001 to 1"),
                ),
                Err(_) => p.add(
                    format!("shed.shares.{class}"),
                    "not a class (critical_plus, critical, sheddable_plus, sheddable)",
                ),
            }
        }
        if let Some(from) = spec.fair_from {
            if !(from.is_finite() && from > 0.0 && from <= 1.0) {
                p.add("shed.fair_from", format!("{from}: give a number in (0, 1]"));
            }
            builder = builder.fair_from(from);
        }
        if let Some(cap) = spec.fair_cap {
            if !(cap.is_finite() && (0.001..=1.0).contains(&cap)) {
                p.add("shed.fair_cap", format!("{cap}: give 0.001 to 1"));
            }
            if spec.fair_by.is_none() {
                p.add("shed.fair_cap", "only with fair_by");
            }
            builder = builder.fair_cap(cap);
        }
        if let Some(queue) = &spec.queue {
            queue_ok(queue, "shed.queue", p);
            builder = builder.queue(queue.max_waiting, queue.max_wait.get());
        }
        if let Some(name) = &spec.deadline_header {
            if spec.queue.is_none() {
                p.add("shed.deadline_header", "only with a queue");
            }
            match HeaderName::from_bytes(name.as_bytes()) {
                Ok(name) => builder = builder.deadline_header(name),
                Err(_) => p.add(
                    "shed.deadline_header",
                    format!("not a header name: {name:?}"),
                ),
            }
        }
        if let Some(name) = &spec.fair_by {
            if let Some(key) = self.rule_key(Some(name), "shed.fair_by") {
                builder = builder.fair_by(key);
            }
        }
        if !self.problems.is_empty() {
            return None;
        }
        match builder.build() {
            Ok(layer) => Some(layer),
            Err(e) => {
                self.problems.add("shed", e);
                None
            }
        }
    }
}
