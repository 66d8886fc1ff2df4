//! No import circles between the modules of a crate (docs/ARCHITECTURE.md, "Dependency rules").
//!
//! Within every module directory of every workspace crate, the child modules must form a
//! directed acyclic graph: if `a` uses something of `b` (`crate::b::…`, `super::b::…`, or an
//! item the parent re-exports from `b`), `b` must not use anything of `a`, directly or through
//! other siblings. A circle means the two modules are one concern split in the wrong place
//! (typically: shared types living in the loop that spawns their users), and it makes neither
//! readable on its own.
//!
//! The check reads the sources as text, which is enough for how this workspace writes paths:
//! `use`/paths beginning with `crate::`, `super::` or `self::` (grouped forms included). Comments
//! (doc links included) and inline `#[cfg(test)]` modules and `tests.rs` files are left out:
//! a test may use any module it tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path from its crate's root, e.g. `["runner", "host"]`.
type ModPath = Vec<String>;

struct SourceFile {
    module: ModPath,
    path: PathBuf,
    /// Production text: comments and inline test modules removed.
    text: String,
}

/// The crate roots (lib and bin targets) of every workspace member, from `cargo metadata`.
fn crate_roots() -> Vec<(String, PathBuf)> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(&workspace)
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("metadata is JSON");
    let mut roots = BTreeMap::new();
    for package in metadata["packages"].as_array().expect("packages") {
        for target in package["targets"].as_array().expect("targets") {
            let kinds: Vec<&str> = target["kind"]
                .as_array()
                .expect("kind")
                .iter()
                .filter_map(|k| k.as_str())
                .collect();
            if kinds
                .iter()
                .any(|k| matches!(*k, "lib" | "bin" | "proc-macro" | "rlib"))
            {
                let path = PathBuf::from(target["src_path"].as_str().expect("src_path"));
                let name = format!(
                    "{} ({})",
                    package["name"].as_str().unwrap_or("?"),
                    target["name"].as_str().unwrap_or("?")
                );
                roots.insert(path, name);
            }
        }
    }
    roots.into_iter().map(|(path, name)| (name, path)).collect()
}

/// Removes `//` comments (line and doc) and everything from an inline `#[cfg(test)] mod … {`
/// on: this workspace keeps inline test modules at the end of their file.
fn production_text(source: &str) -> String {
    let mut out = String::new();
    let lines: Vec<&str> = source.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            let next = lines.get(i + 1).map(|l| l.trim_start()).unwrap_or_default();
            if next.starts_with("mod ") && next.trim_end().ends_with('{') {
                break;
            }
        }
        if trimmed.starts_with("//") {
            continue;
        }
        // A trailing comment (not inside a string: good enough for paths).
        let code = match line.find("// ") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// `mod name;` declarations of a file that are not test-only.
fn declared_modules(source: &str) -> Vec<String> {
    let lines: Vec<&str> = source.lines().collect();
    let mut names = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim();
        let Some(decl) = trimmed.strip_suffix(';') else {
            continue;
        };
        let decl = decl
            .strip_prefix("pub(crate) ")
            .or_else(|| decl.strip_prefix("pub(super) "))
            .or_else(|| decl.strip_prefix("pub "))
            .unwrap_or(decl);
        let Some(name) = decl.strip_prefix("mod ") else {
            continue;
        };
        if !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let test_only = i > 0 && lines[i - 1].contains("cfg(test)");
        if !test_only && name != "tests" {
            names.push(name.to_owned());
        }
    }
    names
}

/// Every non-test source file of the crate rooted at `root`, with its module path.
fn crate_files(root: &Path) -> Vec<SourceFile> {
    let mut files = Vec::new();
    let mut pending = vec![(Vec::new(), root.to_path_buf())];
    while let Some((module, path)) = pending.pop() {
        let source =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let dir = if module.is_empty() || stem == "mod" {
            path.parent().expect("parent").to_path_buf()
        } else {
            path.with_extension("")
        };
        for child in declared_modules(&source) {
            let flat = dir.join(format!("{child}.rs"));
            let nested = dir.join(&child).join("mod.rs");
            let child_path = if flat.exists() { flat } else { nested };
            if child_path.exists() {
                let mut child_module = module.clone();
                child_module.push(child);
                pending.push((child_module, child_path));
            }
        }
        files.push(SourceFile {
            module,
            path,
            text: production_text(&source),
        });
    }
    files
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The absolute module paths a file refers to through `crate::`, `super::` and `self::`.
fn references(file: &SourceFile) -> Vec<ModPath> {
    let text = &file.text;
    let bytes: Vec<char> = text.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let at_boundary = i == 0 || !(is_ident(bytes[i - 1]) || bytes[i - 1] == ':');
        let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
        let (base, skip): (ModPath, usize) = if at_boundary && rest.starts_with("crate::") {
            (Vec::new(), 7)
        } else if at_boundary && rest.starts_with("super::") {
            let mut base = file.module.clone();
            base.pop();
            (base, 7)
        } else if at_boundary && rest.starts_with("self::") {
            (file.module.clone(), 6)
        } else {
            i += 1;
            continue;
        };
        i += skip;
        let mut path = base;
        // Further `super::` hops, then identifiers separated by `::`.
        loop {
            let rest: String = bytes[i..bytes.len().min(i + 7)].iter().collect();
            if rest.starts_with("super::") {
                path.pop();
                i += 7;
                continue;
            }
            break;
        }
        let mut segments: Vec<String> = Vec::new();
        loop {
            if i < bytes.len() && bytes[i] == '{' {
                let mut prefix = path.clone();
                prefix.append(&mut segments);
                found.extend(group_items(&bytes, &mut i).into_iter().map(|ident| {
                    let mut p = prefix.clone();
                    p.push(ident);
                    p
                }));
                break;
            }
            let start = i;
            while i < bytes.len() && is_ident(bytes[i]) {
                i += 1;
            }
            if i == start {
                break;
            }
            segments.push(bytes[start..i].iter().collect());
            if i + 1 < bytes.len() && bytes[i] == ':' && bytes[i + 1] == ':' {
                i += 2;
                continue;
            }
            break;
        }
        if !segments.is_empty() {
            path.extend(segments);
            found.push(path);
        }
    }
    found
}

/// The first segment of each top-level item of a `{…}` group starting at `bytes[*i]`;
/// leaves `*i` after the group.
fn group_items(bytes: &[char], i: &mut usize) -> Vec<String> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    while *i < bytes.len() {
        match bytes[*i] {
            '{' => {
                depth += 1;
                if depth == 1 {
                    item_start = true;
                }
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    *i += 1;
                    break;
                }
            }
            ',' if depth == 1 => item_start = true,
            c if depth == 1 && item_start && is_ident(c) => {
                let start = *i;
                while *i < bytes.len() && is_ident(bytes[*i]) {
                    *i += 1;
                }
                let ident: String = bytes[start..*i].iter().collect();
                if ident != "self" {
                    items.push(ident);
                }
                item_start = false;
                continue;
            }
            c if !c.is_whitespace() => item_start = false,
            _ => {}
        }
        *i += 1;
    }
    items
}

/// Names a module's own file re-exports from a child: `pub use child::{A, B};` → A, B → child.
fn reexports(file: &SourceFile, children: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for statement in file.text.split(';') {
        let statement = statement.trim();
        let Some(rest) = ["pub use ", "pub(crate) use "]
            .iter()
            .find_map(|p| statement.strip_prefix(p))
        else {
            continue;
        };
        let rest = rest.strip_prefix("self::").unwrap_or(rest);
        let head: String = rest.chars().take_while(|c| is_ident(*c)).collect();
        if !children.contains(&head) {
            continue;
        }
        let tail = &rest[head.len()..];
        let mut ident = String::new();
        for c in tail.chars().chain(std::iter::once(' ')) {
            if is_ident(c) {
                ident.push(c);
            } else if !ident.is_empty() {
                if ident != "self" && ident != "as" {
                    map.insert(std::mem::take(&mut ident), head.clone());
                }
                ident.clear();
            }
        }
    }
    map
}

/// Strongly connected components of size > 1 (Tarjan), each as a sorted list.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on_stack: BTreeSet<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(s: &mut State<'_>, v: &str) {
        s.index.insert(v.to_owned(), s.next);
        s.low.insert(v.to_owned(), s.next);
        s.next += 1;
        s.stack.push(v.to_owned());
        s.on_stack.insert(v.to_owned());
        let targets: Vec<String> = s.edges.get(v).into_iter().flatten().cloned().collect();
        for w in targets {
            if !s.index.contains_key(&w) {
                visit(s, &w);
                let low = s.low[v].min(s.low[&w]);
                s.low.insert(v.to_owned(), low);
            } else if s.on_stack.contains(&w) {
                let low = s.low[v].min(s.index[&w]);
                s.low.insert(v.to_owned(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                let done = w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    let nodes: Vec<String> = edges.keys().cloned().collect();
    for v in nodes {
        if !state.index.contains_key(&v) {
            visit(&mut state, &v);
        }
    }
    state.out
}

/// The circles of one crate, described as `crate: module {a, b, …}` with one example use each.
fn crate_circles(name: &str, root: &Path) -> Vec<String> {
    let files = crate_files(root);
    // Children of every module that has any.
    let mut children: BTreeMap<ModPath, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        if let Some((last, parent)) = file.module.split_last() {
            children
                .entry(parent.to_vec())
                .or_default()
                .insert(last.clone());
        }
    }
    let own_file: BTreeMap<&ModPath, &SourceFile> = files.iter().map(|f| (&f.module, f)).collect();
    // Per parent module: child → children it uses, with one example (file, path) per edge.
    let mut graphs: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut examples: BTreeMap<(ModPath, String, String), String> = BTreeMap::new();
    for file in &files {
        if file.path.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        for reference in references(file) {
            for depth in 0..file.module.len() {
                let parent = &file.module[..depth];
                let from = &file.module[depth];
                if reference.len() <= depth || reference[..depth] != *parent {
                    continue;
                }
                let Some(siblings) = children.get(parent) else {
                    continue;
                };
                let named = &reference[depth];
                let to = if siblings.contains(named) {
                    Some(named.clone())
                } else {
                    own_file
                        .get(&parent.to_vec())
                        .and_then(|f| reexports(f, siblings).get(named).cloned())
                };
                let Some(to) = to else { continue };
                if &to == from {
                    continue;
                }
                graphs
                    .entry(parent.to_vec())
                    .or_default()
                    .entry(from.clone())
                    .or_default()
                    .insert(to.clone());
                examples
                    .entry((parent.to_vec(), from.clone(), to))
                    .or_insert_with(|| {
                        format!("{} uses {}", file.path.display(), reference.join("::"))
                    });
            }
        }
    }
    let mut found = Vec::new();
    for (parent, graph) in &graphs {
        for circle in circles(graph) {
            let module = if parent.is_empty() {
                "crate".to_owned()
            } else {
                parent.join("::")
            };
            let mut uses = Vec::new();
            for from in &circle {
                for to in &circle {
                    if let Some(example) = examples.get(&(parent.clone(), from.clone(), to.clone()))
                    {
                        uses.push(format!("    {from} → {to}: {example}"));
                    }
                }
            }
            found.push(format!(
                "{name}: in {module}, {{{}}} use each other:\n{}",
                circle.join(", "),
                uses.join("\n")
            ));
        }
    }
    found
}

#[test]
fn no_import_circles_between_the_modules_of_a_crate() {
    let mut found = Vec::new();
    for (name, root) in crate_roots() {
        found.extend(crate_circles(&name, &root));
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn the_checker_finds_a_circle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::write(
        src.join("lib.rs"),
        "pub mod a;\npub mod b;\nmod c;\npub use c::Gamma;\n",
    )
    .expect("write");
    std::fs::write(
        src.join("a.rs"),
        "use crate::b::Beta;\n// use crate::c::Gamma;\n",
    )
    .expect("write");
    std::fs::write(src.join("b.rs"), "use crate::{a::Alpha, Gamma};\n").expect("write");
    std::fs::write(
        src.join("c.rs"),
        "pub struct Gamma;\n#[cfg(test)]\nmod tests {\n    use crate::a::Alpha;\n}\n",
    )
    .expect("write");
    let found = crate_circles("fixture", &src.join("lib.rs"));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("{a, b}"), "{}", found[0]);
    // c is used by b (through the re-export) but uses nothing back outside its tests.
    assert!(!found[0].contains("c →"), "{}", found[0]);
}
