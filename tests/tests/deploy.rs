//! The operator files in `deploy/` stay in step with the code: the Grafana dashboard charts
//! every metric the roles declare and nothing they do not, and Prometheus scrapes every role
//! service of `docker-compose.yml` on the port that serves its `/metrics`.

use std::collections::BTreeSet;

use sb_common::telemetry::DEFINITIONS;
use sb_tests::repo_dir;

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_dir().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The metric names in `text`: `sb_…` identifiers without the histogram series suffixes.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(found) = text[i..].find("sb_") {
        let start = i + found;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .map_or(text.len(), |n| start + n);
        if boundary {
            let name = &text[start..end];
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(name);
            names.insert(base.to_owned());
        }
        i = end;
    }
    names
}

#[test]
fn the_dashboard_charts_exactly_the_declared_metrics() {
    let dashboard = read("deploy/grafana/dashboards/switchboard.json");
    let parsed: serde_json::Value = serde_json::from_str(&dashboard).expect("valid JSON");
    assert_eq!(parsed["uid"], "switchboard-overview");
    let charted = metric_names(&dashboard);
    let declared: BTreeSet<String> = DEFINITIONS.iter().map(|d| d.name.to_owned()).collect();
    let unknown: Vec<_> = charted.difference(&declared).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard charts undeclared metrics: {unknown:?}"
    );
    let missing: Vec<_> = declared.difference(&charted).collect();
    assert!(
        missing.is_empty(),
        "declared metrics without a panel: {missing:?}"
    );
}

#[test]
fn prometheus_scrapes_every_role_service_of_the_compose_file() {
    let compose = read("docker-compose.yml");
    let prometheus = read("deploy/prometheus.yml");
    assert!(
        compose.contains("SWITCHBOARD__TELEMETRY__METRICS_LISTEN: 0.0.0.0:9090"),
        "the compose roles serve /metrics on 9090"
    );
    // Service names are the two-space-indented keys under `services:` running a role.
    let mut roles = Vec::new();
    let mut current: Option<String> = None;
    for line in compose.lines() {
        if let Some(name) = line.strip_prefix("  ").and_then(|l| l.strip_suffix(':')) {
            if !name.starts_with(' ') && !name.starts_with('#') {
                current = Some(name.to_owned());
            }
        }
        if let (Some(name), Some(rest)) = (&current, line.trim().strip_prefix("command: [\"")) {
            let role = rest.split('"').next().unwrap_or_default();
            if matches!(role, "gateway" | "orchestrator" | "worker") {
                roles.push((name.clone(), role.to_owned()));
            }
        }
    }
    assert!(
        roles.len() >= 3,
        "roles found in the compose file: {roles:?}"
    );
    for (service, role) in roles {
        let port = if role == "gateway" { 8080 } else { 9090 };
        let target = format!("\"{service}:{port}\"");
        assert!(
            prometheus.contains(&target),
            "deploy/prometheus.yml does not scrape {target} ({role})"
        );
    }
}
