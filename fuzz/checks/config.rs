//! The configuration parser: any text is read without a panic, errors are few and located,
//! a configuration it accepts writes out as TOML that reads back to the same value, and
//! building its layers never panics.

use tollgate::MemoryStore;
use tollgate::config::{Bindings, Config};

pub(crate) fn check(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let config = match Config::from_toml(&text) {
        Ok(config) => config,
        Err(errors) => {
            assert!(!errors.errors().is_empty(), "an error names a problem");
            assert!(errors.errors().len() <= 100, "at most 100 problems");
            assert!(errors.errors().iter().all(|e| !e.message().is_empty()));
            return;
        }
    };
    assert_eq!(config.validate().map_err(|e| e.to_string()), Ok(()));
    let written = config
        .to_toml()
        .expect("an accepted configuration writes out");
    let again = Config::from_toml(&written)
        .unwrap_or_else(|e| panic!("{written:?} does not read back: {e}"));
    assert_eq!(again, config, "{written}");
    let bindings = Bindings::new();
    let _ = config.rate_limit_layer(MemoryStore::new(), &bindings);
    let _ = config.concurrency_layer(&bindings);
    let _ = config.shed_layer(&bindings);
}
