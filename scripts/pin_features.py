#!/usr/bin/env python3
"""Makes a generated workspace build its dependencies as the repository does.

scripts/check-snippets (the README's snippets) checks crates in a
workspace of its own, in the
repository's target directory. A dependency is reused from clippy's build
only if it resolves to the same features and profile there; otherwise
cargo checks it again (and everything above it: a different `tokio` means
most of the tree again). This adds to such a workspace:

- the repository's `[profile.dev]` settings;
- a member crate `pin`, with no code, whose dependencies give every
  package that resolves to fewer features there than in the repository's
  build (`--all-features`, dev-dependencies included, as clippy's
  `--all-targets` resolves it) the repository's features.

A package with a feature the repository lacks is left alone and checked
again. What a pin adds could hide a feature missing from a generated
crate's own manifest: its callers check what they must from the text.

    scripts/pin_features.py WORKSPACE_DIR [CARGO_ARGS...]   (e.g. --all-features)
"""

import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    return str(v)


def resolved_features(cwd, args):
    """{(name, version): features} of the registry packages the workspace
    at `cwd` builds (its members and path dependencies left out)."""
    out = subprocess.run(
        ["cargo", "tree", "--workspace", "--prefix", "none", "-e", "normal,build", *args,
         "-f", "{p}|{f}"],
        cwd=cwd, check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        package, _, features = line.removesuffix(" (*)").partition("|")
        parts = package.split()
        if len(parts) < 2 or "(/" in package:
            continue
        key = (parts[0], parts[1].lstrip("v"))
        found.setdefault(key, set()).update(f for f in features.split(",") if f)
    return found


def profile_lines():
    """The repository's [profile.dev] tables, as TOML lines."""
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        profile = tomllib.load(f).get("profile", {}).get("dev", {})
    lines = []
    plain = {k: v for k, v in profile.items() if k != "package"}
    if plain:
        lines += ["[profile.dev]"] + [f"{k} = {toml_value(v)}" for k, v in plain.items()] + [""]
    for package, settings in profile.get("package", {}).items():
        lines.append(f'[profile.dev.package."{package}"]')
        lines += [f"{k} = {toml_value(v)}" for k, v in settings.items()] + [""]
    return lines


def write_pin(workspace, pins):
    pin = os.path.join(workspace, "pin")
    os.makedirs(os.path.join(pin, "src"), exist_ok=True)
    with open(os.path.join(pin, "src", "lib.rs"), "w") as f:
        f.write("//! No code: its dependencies give packages the repository's features.\n")
    deps = [f"pin{i} = {{ package = {toml_value(name)}, version = {toml_value('=' + version)}, "
            f"default-features = false, features = {toml_value(sorted(features))} }}"
            for i, ((name, version), features) in enumerate(sorted(pins.items()))]
    with open(os.path.join(pin, "Cargo.toml"), "w") as f:
        f.write("\n".join(["[package]", 'name = "workspace-pin"', 'version = "0.0.0"',
                           'edition = "2021"', "publish = false", "", "[dependencies]"]
                          + deps) + "\n")


def pin(workspace, args=()):
    """Adds the profile and the crate `pin` to the workspace at `workspace`
    (its Cargo.toml has a one-line `members = [...]`), resolved with the
    `cargo` arguments `args` (as its build will be); returns the pins."""
    manifest = os.path.join(workspace, "Cargo.toml")
    with open(manifest) as f:
        text = f.read()
    if '"pin"' not in text:
        text, n = re.subn(r"^members = \[(.*)\]$", r'members = [\1, "pin"]', text, flags=re.M)
        if n != 1:
            sys.exit(f"{manifest}: no one-line `members = [...]` to add the crate `pin` to")
        text = text.rstrip("\n") + "\n\n" + "\n".join(profile_lines())
        with open(manifest, "w") as f:
            f.write(text)
    pins = {}
    write_pin(workspace, pins)
    repo = resolved_features(ROOT, ["--all-features", "-e", "dev"])
    for _ in range(4):
        here = resolved_features(workspace, list(args))
        more = {key: repo[key] for key, features in here.items()
                if key not in pins and key in repo and features < repo[key]}
        if not more:
            break
        pins.update(more)
        write_pin(workspace, pins)
    return pins


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: scripts/pin_features.py WORKSPACE_DIR [CARGO_ARGS...]")
    pinned = pin(sys.argv[1], sys.argv[2:])
    print(f"{len(pinned)} packages pinned to the repository's features")
