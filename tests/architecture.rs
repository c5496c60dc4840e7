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
//! * The layers: `docs/architecture.md`'s layer table puts every node in a layer; every edge
//!   goes to a layer at or below its own. The backend names no layer above it, even in its unit
//!   tests, and the training loop names no pipeline action. A test of the check plants a
//!   violation and sees it caught.
//! * Every file under `src/` is named in `docs/architecture.md`, and every module the step's
//!   walk-through names exists (with the item it names after it).

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

/// `code` without the paths of restricted visibility (`pub(in crate::parallel)`), which name
/// where an item may be seen, not a module it uses.
fn without_visibility_paths(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(i) = rest.find("pub(in ") {
        out.push_str(&rest[..i + 3]);
        rest = &rest[i..];
        let end = rest.find(')').unwrap_or(rest.len());
        rest = &rest[end..];
    }
    out.push_str(rest);
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
        let code = without_visibility_paths(&code_lines(&std::fs::read_to_string(file).unwrap()).join("\n"));
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

/// The layer table of `docs/architecture.md` ("## The layers"): each layer's name and the
/// modules it lists (backticked in its second column), bottom layer first.
fn layers() -> Vec<(String, Vec<String>)> {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let section = doc.split("## The layers").nth(1).expect("docs/architecture.md has a section \"## The layers\"");
    let mut out = vec![];
    for line in section.lines().skip_while(|l| !l.starts_with("| layer")).skip(2) {
        if !line.starts_with('|') {
            break;
        }
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        let modules = cols[2].split(',').map(|m| m.trim().trim_matches('`').to_string()).filter(|m| !m.is_empty()).collect();
        out.push((cols[1].to_string(), modules));
    }
    assert!(out.len() >= 5, "the layer table of docs/architecture.md is not where the test reads it: {out:?}");
    out
}

/// The layer of a graph node: that of the longest module in the table that is the node or a
/// module above it (`run::launch` over `run`).
fn layer_of(node: &str, layers: &[(String, Vec<String>)]) -> Option<usize> {
    let segs: Vec<&str> = node.split("::").collect();
    let mut best: Option<(usize, usize)> = None;
    for (i, (_, modules)) in layers.iter().enumerate() {
        for m in modules {
            let ms: Vec<&str> = m.split("::").collect();
            if ms.len() <= segs.len() && segs[..ms.len()] == ms[..] && best.is_none_or(|(len, _)| ms.len() > len) {
                best = Some((ms.len(), i));
            }
        }
    }
    best.map(|(_, i)| i)
}

/// Every edge of `graph` that goes to a layer above its own, and every node without a layer.
fn layer_violations(graph: &BTreeMap<String, BTreeSet<String>>, layers: &[(String, Vec<String>)]) -> Vec<String> {
    let mut out = vec![];
    for (from, tos) in graph {
        let Some(lf) = layer_of(from, layers) else {
            out.push(format!("{from} is in no layer of the table"));
            continue;
        };
        for to in tos {
            match layer_of(to, layers) {
                None => out.push(format!("{to} is in no layer of the table")),
                Some(lt) if lt > lf => out.push(format!("{from} ({}) uses {to} ({}), a layer above it", layers[lf].0, layers[lt].0)),
                Some(_) => {}
            }
        }
    }
    out
}

#[test]
fn every_import_goes_to_a_layer_at_or_below_its_own() {
    let violations = layer_violations(&module_graph(), &layers());
    assert!(violations.is_empty(), "imports against the layer order of docs/architecture.md:\n{}", violations.join("\n"));
}

/// The check itself: the real graph with one planted edge from the backend up to the training
/// loop, and one from a module the table does not place.
#[test]
fn the_layer_check_catches_a_planted_violation() {
    let layers = layers();
    let mut graph = module_graph();
    assert!(layer_violations(&graph, &layers).is_empty());
    graph.entry("backend::cpu".into()).or_default().insert("train".into());
    graph.entry("nowhere".into()).or_default().insert("config".into());
    let found = layer_violations(&graph, &layers);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].contains("backend::cpu (hardware) uses train (training), a layer above it"), "{found:?}");
    assert!(found[1].contains("nowhere is in no layer"), "{found:?}");
}

/// Every module a file names, unit tests included.
fn named_modules(file: &Path, here: &[String], modules: &BTreeSet<Vec<String>>) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(file).unwrap();
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = vec![];
    for words in paths(&without_visibility_paths(&code)) {
        let absolute: Vec<String> = match words[0].as_str() {
            "crate" | "ndtrain" => words[1..].to_vec(),
            "super" => {
                let mut b = here[..here.len().saturating_sub(1)].to_vec();
                let mut rest = &words[1..];
                while rest.first().map(String::as_str) == Some("super") {
                    b.pop();
                    rest = &rest[1..];
                }
                b.extend(rest.iter().cloned());
                b
            }
            _ => continue,
        };
        if let Some(m) = module_of(&absolute, modules) {
            out.push(m);
        }
    }
    out
}

#[test]
fn the_backend_names_no_layer_above_it() {
    let files = source_files();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(_, p)| p.clone()).collect();
    let mut offences = vec![];
    for (file, here) in files.iter().filter(|(_, p)| p.first().map(String::as_str) == Some("backend")) {
        for m in named_modules(file, here, &modules) {
            if ["parallel", "model", "train", "run", "tools"].contains(&m[0].as_str()) {
                offences.push(format!("{}: names {}", file.strip_prefix(repo()).unwrap().display(), m.join("::")));
            }
        }
    }
    assert!(offences.is_empty(), "the backend uses layers above it:\n{}", offences.join("\n"));
}

#[test]
fn the_training_loop_names_no_pipeline_action() {
    let files = source_files();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(_, p)| p.clone()).collect();
    let mut offences = vec![];
    for (file, here) in files.iter().filter(|(_, p)| p.first().map(String::as_str) == Some("train")) {
        let rel = file.strip_prefix(repo()).unwrap().display().to_string();
        let text = std::fs::read_to_string(file).unwrap();
        for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim_start().starts_with("//")) {
            let code = l.split("//").next().unwrap_or("");
            let word =
                |w: &str| code.match_indices(w).any(|(at, _)| !code[at + w.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_'));
            if ["Action", "Forward {", "Backward {", "Weight {"].iter().any(|w| word(w)) {
                offences.push(format!("{rel}:{}: {}", i + 1, l.trim()));
            }
        }
        for m in named_modules(file, here, &modules) {
            if m.starts_with(&["parallel".to_string(), "pp".to_string(), "schedule".to_string()]) {
                offences.push(format!("{rel}: names {}", m.join("::")));
            }
        }
    }
    assert!(offences.is_empty(), "the training loop names pipeline actions (the executor owns them):\n{}", offences.join("\n"));
}

#[test]
fn every_module_the_walk_through_names_exists() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let walk = doc.split("## One optimiser step through the modules").nth(1).unwrap().split("\n## ").next().unwrap();
    let files = source_files();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(_, p)| p.clone()).collect();
    let tops: BTreeSet<&str> = modules.iter().filter_map(|m| m.first().map(String::as_str)).collect();
    let mut named = 0;
    let mut missing = vec![];
    for words in paths(walk) {
        if !tops.contains(words[0].as_str()) {
            continue;
        }
        named += 1;
        let module = module_of(&words, &modules).filter(|m| m.len() + 1 >= words.len());
        let Some(module) = module else {
            missing.push(words.join("::"));
            continue;
        };
        // The item after the module (a function, a type) is defined in the module's files.
        if let Some(item) = words.get(module.len()) {
            let defines = files.iter().filter(|(_, p)| p.starts_with(&module)).any(|(f, _)| {
                let text = std::fs::read_to_string(f).unwrap();
                ["fn ", "struct ", "enum ", "trait ", "type ", "const ", "mod "].iter().any(|k| text.contains(&format!("{k}{item}")))
            });
            if !defines {
                missing.push(words.join("::"));
            }
        }
    }
    assert!(named >= 20, "the walk-through of docs/architecture.md names only {named} modules: is the section there?");
    assert!(missing.is_empty(), "the walk-through of docs/architecture.md names what src/ does not hold: {missing:?}");
}
