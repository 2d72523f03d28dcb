//! The problems of a configuration: each with its path, and all of them at once.

use std::fmt;

/// The most problems one [`ConfigError`] lists; past it, the count of the others.
const MAX_PROBLEMS: usize = 100;

/// One problem of a configuration: where, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    path: String,
    message: String,
}

impl Problem {
    /// Where: `descriptors[0].rate_limit.unit`, after the file's name and `: ` when it has one.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every problem of a configuration, each with its path (at most 100, then a count).
#[derive(Clone, Debug)]
pub struct ConfigError {
    problems: Vec<Problem>,
    more: usize,
}

impl ConfigError {
    /// The problems, in the files' order.
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the Envoy rate limit configuration has problems:")?;
        for p in &self.problems {
            write!(f, "\n  {p}")?;
        }
        if self.more > 0 {
            write!(f, "\n  ... and {} more", self.more)?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigError {}

#[derive(Default)]
pub(super) struct Problems {
    list: Vec<Problem>,
    more: usize,
}

impl Problems {
    pub(super) fn push(&mut self, path: String, message: String) {
        if self.list.len() < MAX_PROBLEMS {
            self.list.push(Problem { path, message });
        } else {
            self.more += 1;
        }
    }

    pub(super) fn finish(self) -> Result<(), ConfigError> {
        if self.list.is_empty() {
            Ok(())
        } else {
            Err(ConfigError {
                problems: self.list,
                more: self.more,
            })
        }
    }
}
