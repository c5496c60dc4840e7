//! `ndtrain gpu-check`: an MPI program in which every rank opens the GPU training would give it
//! (`run::gpus`) and checks it against the host ([`ops`], feature `cuda`): every backend
//! operation, a model step, and an all-reduce over the job and over each group of `--layout`'s
//! mesh on the collectives training would use there — NCCL with a GPU per rank, staged through
//! host memory where ranks share one. Rank 0 prints each rank's lines in order. The ranks agree
//! before every collective, so a rank that cannot open its GPU or its communicator ends the
//! check on every rank, not in a wait.

#[cfg(feature = "cuda")]
pub mod ops;

use crate::config::Layout;

/// How a check ended when not every check passed: the exit code, and the message the rank that
/// reports it prints (`None` on the others).
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: Option<String>,
}

/// `gpu-check --layout R,S,C,T`: the mesh degrees `dp_replicate,dp_shard,cp,tp`, whose product
/// must be the number of ranks.
pub fn parse_layout(text: &str, ranks: usize) -> Result<Layout, String> {
    let degrees: Vec<usize> = text
        .split(',')
        .map(|x| x.trim().parse::<usize>().ok().filter(|&d| d >= 1))
        .collect::<Option<_>>()
        .filter(|d: &Vec<usize>| d.len() == 4)
        .ok_or_else(|| format!("--layout {text:?}: expected four degrees ≥ 1, dp_replicate,dp_shard,cp,tp (e.g. 1,2,1,4)"))?;
    let layout = Layout { pp: 1, dp_replicate: degrees[0], dp_shard: degrees[1], cp: degrees[2], tp: degrees[3], ep: 1 };
    // Checked without overflow: a product beyond usize is simply not the number of ranks.
    let product = degrees.iter().try_fold(1usize, |p, &d| p.checked_mul(d));
    if product != Some(ranks) {
        return Err(format!(
            "--layout {text}: dp_replicate·dp_shard·cp·tp must equal the {ranks} rank(s) of the job, not {}",
            degrees.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("·")
        ));
    }
    Ok(layout)
}

/// Without the `cuda` feature there is no GPU to check: bad input, said once.
#[cfg(not(feature = "cuda"))]
pub fn run(_layout: Option<String>) -> Result<Option<String>, Failure> {
    Err(Failure {
        code: crate::exit::BAD_INPUT,
        message: Some("this ndtrain was built without the `cuda` feature: rebuild with `cargo build --release --features cuda`".into()),
    })
}

/// Runs the check on every rank of the job; MPI is finalised when it returns. Returns rank 0's
/// report (every rank's lines, `None` on the other ranks) when every check on every rank passed.
#[cfg(feature = "cuda")]
pub fn run(layout: Option<String>) -> Result<Option<String>, Failure> {
    use crate::parallel::comm::Runtime;
    use crate::parallel::mesh::Mesh;
    let rt = Runtime::init();
    let world = rt.world();
    let root = world.rank() == 0;
    // A bad layout is bad input: every rank sees the same string and stops before any GPU work.
    let mesh = match layout.map(|l| parse_layout(&l, world.size())).transpose() {
        Ok(l) => l.map(|l| Mesh::new(rt.world(), l)),
        Err(e) => return Err(Failure { code: crate::exit::BAD_INPUT, message: root.then_some(e) }),
    };
    let node = crate::parallel::mesh::node_group(&world);
    let outcome = checks(&world, &node, mesh.as_ref());
    // Every rank's lines, in rank order, on rank 0.
    let mine = outcome.as_ref().map(|t| t.clone().into_bytes()).unwrap_or_default();
    let all: Vec<String> = world.all_gather_bytes(&mine).iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
    let ranks = world.size();
    drop((mesh, node, world));
    drop(rt);
    match outcome {
        Ok(_) => Ok(root.then(|| format!("{}\nevery GPU check passed on {ranks} rank(s)", all.join("\n")))),
        Err(e) => Err(Failure { code: crate::exit::RUN_FAILED, message: root.then_some(e) }),
    }
}

/// This rank's checks, agreed over the world after each stage: choosing and opening the GPU
/// (as training does: `run::gpus`), the backend's operations, and one NCCL communicator per
/// group (its bootstrap agrees before and after its collective calls). Every rank returns the
/// same verdict: its own lines, or the lowest failing rank's message.
#[cfg(feature = "cuda")]
fn checks(
    world: &crate::parallel::comm::Group,
    node: &crate::parallel::comm::Group,
    mesh: Option<&crate::parallel::mesh::Mesh>,
) -> Result<String, String> {
    use crate::backend::Backend;
    use crate::run::gpus::{self, RankView};
    let visible = crate::backend::cuda::visible_gpus();
    let view =
        RankView { visible: visible.clone().unwrap_or_default(), numa_nodes: gpus::numa_nodes_of(&crate::run::placement::affinity()) };
    let assigned = gpus::assign_on_node(node, &view).and_then(|a| visible.map(|_| a));
    let assignment = world.agree(assigned)?;
    let (gpu, shared) = (assignment.gpu, world.count_true(assignment.shared) > 0);
    let be = world.agree(crate::backend::cuda::backend::GpuBackend::open(gpu.ordinal, crate::backend::Precision::Fp32))?;
    let mut lines = vec![format!("rank {} (node rank {}): GPU {}: {}", world.rank(), node.rank(), gpus::describe(&gpu), be.describe())];
    let mut results = ops::check_backend(&be);
    results.push(world.agree(ops::check_all_reduce(&be, world, shared))?);
    for g in mesh.map(|m| m.groups().to_vec()).unwrap_or_default() {
        results.push(world.agree(ops::check_all_reduce(&be, g, shared))?);
    }
    let mut failed = 0;
    for c in &results {
        failed += !c.ok() as usize;
        let verdict = if c.ok() { "ok" } else { "FAILED" };
        lines.push(format!("  {:<64} relative error {:.2e} (tolerance {:.0e})  {verdict}", c.what, c.rel_err, c.tol));
    }
    let local = if failed > 0 { Err(format!("{failed} GPU check(s) failed:\n{}", lines.join("\n"))) } else { Ok(lines.join("\n")) };
    world.agree(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_must_have_four_degrees_whose_product_is_the_ranks() {
        let l = parse_layout("1, 2,1,4", 8).unwrap();
        assert_eq!((l.dp_replicate, l.dp_shard, l.cp, l.tp), (1, 2, 1, 4));
        for (bad, want) in
            [("1,2,1", "four degrees"), ("1,2,0,4", "four degrees"), ("a,2,1,4", "four degrees"), ("2,2,1,4", "equal the 8 rank(s)")]
        {
            let e = parse_layout(bad, 8).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        assert!(parse_layout("18446744073709551615,2,1,1", 8).unwrap_err().contains("equal the 8"));
    }
}
