//! Criterion benches of the payload fingerprint: RFC 8785 canonical JSON
//! then SHA-256, which `Idempotency::process` computes on every call.
//!
//! ```text
//! cargo bench --bench canonical
//! ```

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use idemkit::{canonical_json, Fingerprint};
use serde::Serialize;

/// A payment message: the shape of a typical payload.
#[derive(Serialize)]
struct Payment {
    payment_id: String,
    customer: String,
    amount_cents: u64,
    currency: &'static str,
    captured: bool,
    fee_rate: f64,
    tags: Vec<&'static str>,
    note: Option<String>,
}

fn payment() -> Payment {
    Payment {
        payment_id: "pay_01HZX3Q2V7J8K9M0N1P2Q3R4S5".to_owned(),
        customer: "cus_8842".to_owned(),
        amount_cents: 129_900,
        currency: "EUR",
        captured: true,
        fee_rate: 0.029,
        tags: vec!["web", "first-order"],
        note: None,
    }
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("fingerprint");
    g.bench_function("u64", |b| b.iter(|| Fingerprint::of(black_box(&42u64))));
    let p = payment();
    g.bench_function("struct-8-fields", |b| {
        b.iter(|| Fingerprint::of(black_box(&p)))
    });
    g.bench_function("struct-8-fields/canonical-json-only", |b| {
        b.iter(|| canonical_json(black_box(&p)))
    });
    let value = serde_json::to_value(&p).unwrap_or_default();
    g.bench_function("json-value-8-fields", |b| {
        b.iter(|| Fingerprint::of(black_box(&value)))
    });
    let orders: Vec<Payment> = (0..100).map(|_| payment()).collect();
    g.bench_function("vec-100-structs", |b| {
        b.iter(|| Fingerprint::of(black_box(&orders)))
    });
    g.finish();
}

criterion_group!(canonical, benches);
criterion_main!(canonical);
