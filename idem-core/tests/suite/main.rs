//! idem-core's behaviour through its public API, on `MemoryStore`: the
//! executor (single calls and batches), the metrics it emits, and the
//! properties of keys, fingerprints and the canonical JSON behind them.
//!
//! One test binary; each module is an area.

mod batch;
mod canonical;
mod executor;
mod keys;
mod metrics;
