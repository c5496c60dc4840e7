//! The architecture holds: the boundaries between layers and the module graph that
//! `docs/architecture.md` draws, read from the source itself.
//!
//! * Boundaries: only `parallel::comm` names the `mpi` crate, only `io::hdf5` the `hdf5` crates,
//!   only `backend::cuda` names `cudarc`, and nothing below the command line imports from it.
//! * The module graph: one node per module that is part of the API at depth one or two
//!   (`model`, `parallel::fsdp`, …); a private submodule (`mod block;`) and anything deeper
//!   belong to their parent. An edge is a `crate::`/`super::` path (a `use` or a qualified name)
//!   outside the unit tests at the end of a file. The graph has no cycle, and its transitive
//!   reduction is the mermaid picture in `docs/architecture.md` (when they differ the test
//!   prints the picture the code draws).
//! * Every file under `src/` is named in `docs/architecture.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `src/`, with its module path (`["parallel", "fsdp", "grads"]`).
fn source_files() -> Vec<(PathBuf, Vec<String>)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let src = repo().join("src");
    let mut files = vec![];
    walk(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(&src).unwrap().with_extension("");
            let mut path: Vec<String> = rel.iter().map(|c| c.to_string_lossy().to_string()).collect();
            if matches!(path.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                path.pop();
            }
            (p, path)
        })
        .collect()
}

/// The lines of a file that are code: before its unit tests, without comments.
fn code_lines(text: &str) -> Vec<&str> {
    let end = text.find("#[cfg(test)]").unwrap_or(text.len());
    text[..end].lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| l.split("//").next().unwrap_or("")).collect()
}

/// Whether a line names the crate `name` as a path root (`name::…`, not `io::name::…`).
fn names_crate(line: &str, name: &str) -> bool {
    let pat = format!("{name}::");
    line.match_indices(&pat).any(|(i, _)| {
        let before = line[..i].chars().next_back();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
    })
}

/// What a boundary protects, the files allowed to cross it, and how a line crosses it.
type Rule = (&'static str, &'static [&'static str], fn(&str) -> bool);

#[test]
fn only_the_boundary_modules_name_their_libraries() {
    let rules: [Rule; 4] = [
        ("the mpi crate", &["src/parallel/comm/"], |l| names_crate(l, "mpi") || names_crate(l, "mpi_sys")),
        ("the hdf5 crates", &["src/io/hdf5.rs"], |l| names_crate(l, "hdf5") || names_crate(l, "hdf5_sys")),
        ("cudarc", &["src/backend/cuda/"], |l| names_crate(l, "cudarc")),
        ("the command line", &["src/cli.rs", "src/main.rs"], |l| l.contains("crate::cli") || l.contains("ndtrain::cli")),
    ];
    let mut offences = vec![];
    for (file, _) in source_files() {
        let rel = file.strip_prefix(repo()).unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        for (what, allowed, names) in &rules {
            if allowed.iter().any(|a| rel.starts_with(a)) {
                continue;
            }
            for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim_start().starts_with("//")) {
                if names(l) {
                    offences.push(format!("{rel}:{}: names {what}: {}", i + 1, l.trim()));
                }
            }
        }
    }
    assert!(offences.is_empty(), "modules outside the boundary:\n{}", offences.join("\n"));
}

/// Which submodules each module declares public (`pub mod x;`) or private (`mod x;`).
fn declarations(files: &[(PathBuf, Vec<String>)]) -> BTreeMap<Vec<String>, bool> {
    let mut public = BTreeMap::new();
    for (file, path) in files {
        for l in code_lines(&std::fs::read_to_string(file).unwrap()) {
            let l = l.trim();
            let l = l.strip_prefix("#[cfg(feature = \"cuda\")]").unwrap_or(l).trim();
            let (is_pub, rest) = match l.strip_prefix("pub mod ") {
                Some(r) => (true, r),
                None => match l.strip_prefix("mod ") {
                    Some(r) => (false, r),
                    None => continue,
                },
            };
            if let Some(name) = rest.strip_suffix(';') {
                let mut child = path.clone();
                child.push(name.to_string());
                public.insert(child, is_pub);
            }
        }
    }
    public
}

/// The graph node a module belongs to: its first one or two levels, and only public ones.
fn node(path: &[String], public: &BTreeMap<Vec<String>, bool>) -> String {
    let mut n = vec![];
    for seg in path.iter().take(2) {
        let mut next = n.clone();
        next.push(seg.clone());
        if n.is_empty() || public.get(&next).copied().unwrap_or(false) {
            n = next;
        } else {
            break;
        }
    }
    n.join("::")
}

/// Every path a piece of code names, `use` groups expanded (`a::{b, c::d}` gives `a::b` and
/// `a::c::d`): each as its words.
fn paths(code: &str) -> Vec<Vec<String>> {
    fn word(chars: &[char], i: &mut usize) -> String {
        let start = *i;
        while *i < chars.len() && (chars[*i].is_alphanumeric() || chars[*i] == '_') {
            *i += 1;
        }
        chars[start..*i].iter().collect()
    }
    fn skip_space(chars: &[char], i: &mut usize) {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    }
    /// Reads a path from `i` (its first word already read as `prefix`), pushing every
    /// expansion to `out`.
    fn rest(chars: &[char], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut p = prefix;
        loop {
            if chars.get(*i) == Some(&':') && chars.get(*i + 1) == Some(&':') {
                *i += 2;
                skip_space(chars, i);
                if chars.get(*i) == Some(&'{') {
                    *i += 1;
                    loop {
                        skip_space(chars, i);
                        match chars.get(*i) {
                            Some('}') => {
                                *i += 1;
                                return;
                            }
                            Some(',') => *i += 1,
                            Some(c) if c.is_alphanumeric() || *c == '_' => {
                                let w = word(chars, i);
                                let mut sub = p.clone();
                                sub.push(w);
                                rest(chars, i, sub, out);
                                // `self as x`, `x as y`: skip to the next item.
                                while *i < chars.len() && !matches!(chars[*i], ',' | '}') {
                                    *i += 1;
                                }
                            }
                            Some(_) => *i += 1,
                            None => return,
                        }
                    }
                }
                let w = word(chars, i);
                if w.is_empty() {
                    break;
                }
                p.push(w);
            } else {
                break;
            }
        }
        out.push(p);
    }
    let chars: Vec<char> = code.chars().collect();
    let mut out = vec![];
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphanumeric() || c == '_' {
            let before = if i == 0 { ' ' } else { chars[i - 1] };
            let w = word(&chars, &mut i);
            if before != ':' && before != '$' && !before.is_alphanumeric() && chars.get(i) == Some(&':') {
                rest(&chars, &mut i, vec![w], &mut out);
            }
        } else {
            i += 1;
        }
    }
    out
}

/// The module graph of `src/` (node → nodes it uses).
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let files = source_files();
    let public = declarations(&files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(_, p)| p.clone()).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, here) in &files {
        if here.is_empty() || here == &["cli".to_string()] {
            continue; // the crate root and the command line sit on top of everything
        }
        let from = node(here, &public);
        graph.entry(from.clone()).or_default();
        let code = code_lines(&std::fs::read_to_string(file).unwrap()).join("\n");
        for words in paths(&code) {
            let words: Vec<&str> = words.iter().map(String::as_str).collect();
            // `crate::…`, `super::…`, `self::…`, or a path starting at a submodule of this one.
            let absolute: Vec<String> = match words[0] {
                "crate" => words[1..].iter().map(|w| w.to_string()).collect(),
                "super" => {
                    let mut b = here[..here.len().saturating_sub(1)].to_vec();
                    let mut rest = &words[1..];
                    while rest.first() == Some(&"super") {
                        b.pop();
                        rest = &rest[1..];
                    }
                    b.extend(rest.iter().map(|w| w.to_string()));
                    b
                }
                "self" => here.iter().cloned().chain(words[1..].iter().map(|w| w.to_string())).collect(),
                w if modules.contains(&[here.as_slice(), &[w.to_string()]].concat()) => {
                    here.iter().cloned().chain(words.iter().map(|w| w.to_string())).collect()
                }
                _ => continue,
            };
            let Some(t) = module_of(&absolute, &modules) else { continue };
            let to = node(&t, &public);
            if !to.is_empty() && to != from && to != "cli" {
                graph.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    graph
}

/// The module an absolute path names: its longest prefix that is a module (the console macro
/// `say` is `metrics`').
fn module_of(path: &[String], modules: &BTreeSet<Vec<String>>) -> Option<Vec<String>> {
    if path.first().map(String::as_str) == Some("say") {
        return Some(vec!["metrics".into()]);
    }
    (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|p| modules.contains(p))
}

/// Every node reachable from `n` (not `n` itself unless on a cycle).
fn reachable(graph: &BTreeMap<String, BTreeSet<String>>, n: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack: Vec<String> = graph.get(n).map(|s| s.iter().cloned().collect()).unwrap_or_default();
    while let Some(m) = stack.pop() {
        if seen.insert(m.clone()) {
            stack.extend(graph.get(&m).into_iter().flatten().cloned());
        }
    }
    seen
}

/// The edges of the transitive reduction (of an acyclic graph).
fn reduction(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (u, vs) in graph {
        for v in vs {
            let implied = vs.iter().any(|w| w != v && reachable(graph, w).contains(v));
            if !implied {
                out.insert((u.clone(), v.clone()));
            }
        }
    }
    out
}

fn mermaid_id(node: &str) -> String {
    node.replace("::", "_")
}

/// The picture the code draws: one subgraph per layer area, edges of the reduction.
fn mermaid(graph: &BTreeMap<String, BTreeSet<String>>) -> String {
    let mut areas: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
    for n in graph.keys() {
        areas.entry(n.split("::").next().unwrap()).or_default().push(n);
    }
    let mut s = String::from("```mermaid\nflowchart TD\n");
    for (area, nodes) in &areas {
        if nodes.len() == 1 && nodes[0] == area {
            s += &format!("    {}[\"{}\"]\n", mermaid_id(area), area);
            continue;
        }
        s += &format!("    subgraph {area}_area[\"{area}\"]\n");
        for n in nodes {
            s += &format!("        {}[\"{}\"]\n", mermaid_id(n), n);
        }
        s += "    end\n";
    }
    for (u, v) in reduction(graph) {
        s += &format!("    {} --> {}\n", mermaid_id(&u), mermaid_id(&v));
    }
    s + "```\n"
}

#[test]
fn the_module_graph_has_no_cycle() {
    let graph = module_graph();
    let cyclic: Vec<&String> = graph.keys().filter(|n| reachable(&graph, n).contains(*n)).collect();
    let describe = |n: &String| format!("{n} -> {:?}", graph[n]);
    assert!(cyclic.is_empty(), "modules on a cycle:\n{}", cyclic.iter().map(|n| describe(n)).collect::<Vec<_>>().join("\n"));
}

#[test]
fn the_architecture_doc_draws_the_module_graph_and_names_every_file() {
    let graph = module_graph();
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let want = mermaid(&graph);
    assert!(doc.contains(&want), "docs/architecture.md does not hold the module graph the code draws; the picture is:\n\n{want}");
    let missing: Vec<String> = source_files()
        .into_iter()
        .map(|(f, _)| f.strip_prefix(repo()).unwrap().to_string_lossy().to_string())
        .filter(|f| !doc.contains(f.as_str()))
        .collect();
    assert!(missing.is_empty(), "docs/architecture.md does not name: {missing:?}");
}
