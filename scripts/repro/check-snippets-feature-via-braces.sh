#!/usr/bin/env bash
# scripts/check-snippets must refuse a README snippet that does not compile
# in a user's crate with the README's TOML alone. Here: a snippet in the
# Quickstart's group (idem without features) naming `idemkit::postgres`
# through a brace import, `use idemkit::{postgres::PgStore, Idempotency};`.
# A user's crate fails (no `postgres` module without the feature). The
# text check only sees `idemkit::postgres` written out, and the one-workspace
# build unifies idem's features with the postgres group's, so the snippet
# compiles there.
#
# Exit 0: check-snippets caught it (good). Exit 1: it passed (the bug).
set -uo pipefail
cd "$(dirname "$0")/../.."
cp README.md /tmp/README.md.check-snippets-repro
trap 'cp /tmp/README.md.check-snippets-repro README.md' EXIT
cat >>README.md <<'MD'

## Reproduction: a feature reached through a brace import

```rust,no_run
use idemkit::{postgres::PgStore, Idempotency};
fn main() {
    let _ = std::mem::size_of::<Option<Idempotency<PgStore>>>();
}
```
MD
if scripts/check-snippets; then
  echo "REPRODUCED: check-snippets passed a snippet that needs feature postgres its TOML lacks" >&2
  exit 1
fi
echo "check-snippets caught the missing feature"
