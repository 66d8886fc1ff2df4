//! The workspace's crate boundaries, checked over `cargo metadata`.
//!
//! The roles (gateway, orchestrator, worker) are peers: each is deployed, scaled and
//! restarted on its own, and talks to the others only through the bus and the stores. A
//! role crate that links another one would let their internals leak into each other (and
//! rebuild both for every change of either), so a rule two roles need lives below them, in
//! a shared crate (`sb-protocol`, `sb-common`, `sb-store`, `sb-rules`, `sb-lifecycle`). Only
//! the crates that wire roles together (the root crate `switchboard`, this harness) link
//! several roles.
//!
//! The check reads the manifests (`cargo metadata --no-deps`), so it covers every kind of
//! dependency: normal, dev (a role's tests must not need another role either) and build.

use std::process::Command;

use serde_json::Value;

/// The role crates: none of them may depend on another.
const ROLES: [&str; 3] = ["sb-gateway", "sb-orchestrator", "sb-worker"];

/// The workspace's packages as `cargo metadata` reports them.
fn workspace_packages() -> Vec<Value> {
    let output = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    metadata["packages"]
        .as_array()
        .expect("cargo metadata lists packages")
        .clone()
}

/// Every dependency of a role crate on another role crate, as `from -> to (kind)`.
fn role_to_role_dependencies(packages: &[Value]) -> Vec<String> {
    let mut found = Vec::new();
    for package in packages {
        let Some(name) = package["name"].as_str() else {
            continue;
        };
        if !ROLES.contains(&name) {
            continue;
        }
        for dependency in package["dependencies"].as_array().into_iter().flatten() {
            // `name` is the package depended on, whatever it is renamed to.
            let Some(target) = dependency["name"].as_str() else {
                continue;
            };
            if ROLES.contains(&target) && target != name {
                let kind = dependency["kind"].as_str().unwrap_or("normal");
                found.push(format!("{name} -> {target} ({kind})"));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn no_role_crate_depends_on_another_role_crate() {
    let packages = workspace_packages();
    let names: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    for role in ROLES {
        // A renamed or removed role would make the check below pass vacuously.
        assert!(names.contains(&role), "no package {role} in {names:?}");
    }
    let edges = role_to_role_dependencies(&packages);
    assert!(
        edges.is_empty(),
        "role crates must not depend on each other (move the shared rule into a shared \
         crate instead): {edges:#?}"
    );
}
