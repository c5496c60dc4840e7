//! The CUDA backend: [`Backend`] on the rank's GPU. Every operation is one kernel of
//! `kernels.cu` or one cuBLAS call on device buffers, launched on the GPU's stream in order;
//! the host waits only where a value comes back (the loss, the gradient norm). The linear
//! layers' GEMMs run in fp32 or, with `precision = "bf16"`, on bf16 copies of their operands
//! with f32 accumulation (tensor cores); attention's batched GEMMs in fp32 or, under bf16, with
//! TF32 products; everything else stays f32.
//!
//! A failing CUDA call panics with its message: the panic hook aborts the MPI job (what can
//! fail before the first step — a missing library, no GPU — is an error from [`GpuBackend::open`]).

use super::{Gpu, Operand};
use crate::backend::{AdamStep, Backend, Precision};
use crate::model::attention::AttnDims;
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use std::cell::RefCell;
use std::rc::Rc;

/// A device tensor; empty (no allocation: CUDA has no zero-byte buffers) when its length is 0.
pub struct DevBuf<T>(Option<CudaSlice<T>>);

impl<T> Default for DevBuf<T> {
    fn default() -> Self {
        DevBuf(None)
    }
}

impl<T> DevBuf<T> {
    fn get(&self) -> &CudaSlice<T> {
        self.0.as_ref().expect("a GPU buffer of length 0 was used")
    }
    fn get_mut(&mut self) -> &mut CudaSlice<T> {
        self.0.as_mut().expect("a GPU buffer of length 0 was used")
    }
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Token ids on the device, and for the embedding backward the same ids sorted: the distinct
/// ids, where each one's tokens start in `order`, and the token indices grouped by id (each
/// group ascending, so a row's gradient is summed in token order, as on the CPU).
#[derive(Default)]
pub struct DevIds {
    ids: DevBuf<u32>,
    uniq: DevBuf<u32>,
    starts: DevBuf<i32>,
    order: DevBuf<i32>,
}

/// The rank's GPU as a backend: a cheap handle (clones share the GPU and its scratch; each
/// clone has its own GEMM precision).
#[derive(Clone)]
pub struct GpuBackend {
    shared: Rc<Shared>,
    precision: Precision,
}

struct Shared {
    gpu: Gpu,
    /// bf16 copies of a GEMM's two operands (grown to the largest seen).
    bf16: RefCell<(DevBuf<u16>, DevBuf<u16>)>,
    /// Attention backward's `rowsum(dO ∘ O)` scratch.
    rowdot: RefCell<DevBuf<f32>>,
    /// Attention's scores (then probabilities) and, in backward, their gradient, for one chunk
    /// of (batch, kv head) groups.
    scores: RefCell<DevBuf<f32>>,
    dscores: RefCell<DevBuf<f32>>,
    /// The gradient norm's per-block partial sums.
    partials: RefCell<DevBuf<f64>>,
}

/// Blocks of the gradient-norm reduction (a fixed grid: the sum is deterministic).
const SUM_SQ_BLOCKS: usize = 1024;

/// Elements of one attention score buffer (1 GiB of f32): the (batch, kv head) groups are
/// processed in chunks that fit it.
const SCORES_CAP: usize = 1 << 28;

/// How one attention call is cut: `groups = B·KV` products of `rep·Sq` query rows (the query
/// heads sharing a kv head, stacked) against `Sk` keys, `chunk` groups at a time.
struct AttnPlan {
    groups: usize,
    chunk: usize,
    /// Query rows of one group, and the elements of a group's q / k block and scores.
    rows: usize,
    q_block: usize,
    k_block: usize,
    s_block: usize,
    sq: usize,
    sk: usize,
    hd: usize,
    scale: f32,
}

impl AttnPlan {
    fn new(dm: AttnDims) -> AttnPlan {
        let i32_ok = [dm.b * dm.h * dm.sq, dm.sq, dm.sk, dm.hd].iter().all(|&x| i32::try_from(x).is_ok());
        assert!(i32_ok && dm.kv > 0 && dm.h % dm.kv == 0, "attention sizes {dm:?} beyond the GPU kernels' 32-bit indices");
        let rows = dm.h / dm.kv * dm.sq;
        let s_block = rows * dm.sk;
        let groups = dm.b * dm.kv;
        AttnPlan {
            groups,
            chunk: (SCORES_CAP / s_block.max(1)).clamp(1, groups.max(1)),
            rows,
            q_block: rows * dm.hd,
            k_block: dm.sk * dm.hd,
            s_block,
            sq: dm.sq,
            sk: dm.sk,
            hd: dm.hd,
            scale: 1.0 / (dm.hd as f32).sqrt(),
        }
    }

    /// `(first group, groups)` of each chunk.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.groups).step_by(self.chunk).map(|g| (g, self.chunk.min(self.groups - g)))
    }
}

fn ok<R>(what: &str, r: Result<R, String>) -> R {
    r.unwrap_or_else(|e| panic!("GPU {what}: {e}"))
}

impl GpuBackend {
    /// Opens the GPU of this node-local rank and compiles the kernels for it.
    pub fn open(node_rank: usize, precision: Precision) -> Result<GpuBackend, String> {
        let gpu = Gpu::open(node_rank)?;
        let partials = RefCell::new(DevBuf(Some(gpu.zeros::<f64>(SUM_SQ_BLOCKS)?)));
        let shared = Shared {
            gpu,
            bf16: RefCell::new(Default::default()),
            rowdot: RefCell::new(DevBuf::default()),
            scores: RefCell::new(DevBuf::default()),
            dscores: RefCell::new(DevBuf::default()),
            partials,
        };
        Ok(GpuBackend { shared: Rc::new(shared), precision })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.shared.gpu
    }

    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> DevBuf<T> {
        DevBuf(if n == 0 { None } else { Some(ok("allocation", self.gpu().zeros::<T>(n))) })
    }

    fn put<T: DeviceRepr + Copy + ValidAsZeroBits>(&self, dst: &mut DevBuf<T>, host: &[T]) {
        if dst.len() != host.len() {
            *dst = self.alloc(host.len());
        }
        if let Some(d) = dst.0.as_mut() {
            ok("copy to the device", self.gpu().stream.memcpy_htod(host, d).map_err(|e| format!("{e:?}")));
        }
    }

    /// Switches the GEMMs' precision (gpu-check runs both on one opened GPU).
    pub fn set_precision(&mut self, p: Precision) {
        self.precision = p;
    }

    /// Row-major `c = op(a) · op(b) (+ c)` in the configured precision: f32, or bf16 copies
    /// of both operands.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, c: &mut DevBuf<f32>, a: &DevBuf<f32>, b: &DevBuf<f32>, mnk: (usize, usize, usize), trans: (bool, bool), acc: bool) {
        if c.is_empty() {
            return;
        }
        let beta = if acc { 1.0 } else { 0.0 };
        if mnk.2 == 0 {
            if !acc {
                ok("gemm", self.gpu().fill(c.get_mut(), 0.0));
            }
            return;
        }
        match self.precision {
            Precision::Fp32 => {
                ok("sgemm", self.gpu().gemm(c.get_mut(), Operand::F32(a.get(), 0), Operand::F32(b.get(), 0), mnk, trans, beta))
            }
            Precision::Bf16 => {
                let mut s = self.shared.bf16.borrow_mut();
                let (sa, sb) = &mut *s;
                for (scratch, x) in [(&mut *sa, a), (&mut *sb, b)] {
                    if scratch.len() < x.len() {
                        *scratch = self.alloc(x.len());
                    }
                }
                ok("to bf16", self.gpu().to_bf16_prefix(sa.get_mut(), a.get()));
                ok("to bf16", self.gpu().to_bf16_prefix(sb.get_mut(), b.get()));
                ok("bf16 gemm", self.gpu().gemm(c.get_mut(), Operand::Bf16(sa.get(), 0), Operand::Bf16(sb.get(), 0), mnk, trans, beta));
            }
        }
    }

    /// A scratch buffer of at least `n` elements (grown, never shrunk).
    fn scratch<'a>(&self, cell: &'a RefCell<DevBuf<f32>>, n: usize) -> std::cell::RefMut<'a, DevBuf<f32>> {
        let mut b = cell.borrow_mut();
        if b.len() < n {
            *b = self.alloc(n);
        }
        b
    }

    /// The GEMM rate of this GPU in the configured precision (FLOP/s): a few 8192³ products
    /// after a warm-up, for the MFU line when the deck states no peak.
    pub fn gemm_probe(&self) -> Result<f64, String> {
        let n = 8192;
        let (a, b) = (DevBuf(Some(self.gpu().zeros::<f32>(n * n)?)), DevBuf(Some(self.gpu().zeros::<f32>(n * n)?)));
        let mut c = DevBuf(Some(self.gpu().zeros::<f32>(n * n)?));
        self.gemm(&mut c, &a, &b, (n, n, n), (false, false), false);
        self.gpu().synchronize()?;
        let reps = 5;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.gemm(&mut c, &a, &b, (n, n, n), (false, false), false);
        }
        self.gpu().synchronize()?;
        Ok(reps as f64 * 2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64())
    }
}

impl Backend<f32> for GpuBackend {
    type Buf = DevBuf<f32>;
    type Ids = DevIds;
    type Pos = DevBuf<i32>;

    fn describe(&self) -> String {
        {
            let g = self.gpu();
            format!("cuda:{} {} (sm_{}{})", g.ordinal, g.name, g.cc.0, g.cc.1)
        }
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn zeros(&self, n: usize) -> DevBuf<f32> {
        self.alloc(n)
    }

    fn len(&self, b: &DevBuf<f32>) -> usize {
        b.len()
    }

    fn upload(&self, dst: &mut DevBuf<f32>, host: &[f32]) {
        self.put(dst, host);
    }

    fn download(&self, src: &DevBuf<f32>, host: &mut [f32]) {
        assert_eq!(src.len(), host.len(), "download: lengths differ");
        if let Some(s) = src.0.as_ref() {
            ok("copy from the device", self.gpu().stream.memcpy_dtoh(s, host).map_err(|e| format!("{e:?}")));
            ok("synchronize", self.gpu().synchronize());
        }
    }

    fn copy(&self, dst: &mut DevBuf<f32>, src: &DevBuf<f32>) {
        assert_eq!(dst.len(), src.len(), "copy: lengths differ");
        if let (Some(d), Some(s)) = (dst.0.as_mut(), src.0.as_ref()) {
            ok("device copy", self.gpu().stream.memcpy_dtod(s, d).map_err(|e| format!("{e:?}")));
        }
    }

    fn fill(&self, dst: &mut DevBuf<f32>, x: f32) {
        if let Some(d) = dst.0.as_mut() {
            ok("fill", self.gpu().fill(d, x));
        }
    }

    fn set_ids(&self, dst: &mut DevIds, host: &[u32]) {
        self.put(&mut dst.ids, host);
        // Token indices grouped by id, ascending within each id (a stable sort).
        let mut order: Vec<i32> = (0..host.len() as i32).collect();
        order.sort_by_key(|&i| host[i as usize]);
        let (mut uniq, mut starts) = (Vec::new(), Vec::new());
        for (k, &i) in order.iter().enumerate() {
            let id = host[i as usize];
            if uniq.last() != Some(&id) {
                uniq.push(id);
                starts.push(k as i32);
            }
        }
        starts.push(order.len() as i32);
        self.put(&mut dst.uniq, &uniq);
        self.put(&mut dst.starts, &starts);
        self.put(&mut dst.order, &order);
    }

    fn set_positions(&self, dst: &mut DevBuf<i32>, host: &[usize]) {
        let p: Vec<i32> = host.iter().map(|&x| i32::try_from(x).expect("a position beyond 2³¹")).collect();
        self.put(dst, &p);
    }

    fn linear_fwd(&self, y: &mut DevBuf<f32>, x: &DevBuf<f32>, w: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        self.gemm(y, x, w, (m, n, k), (false, true), acc);
    }

    fn linear_bwd_input(&self, dx: &mut DevBuf<f32>, dy: &DevBuf<f32>, w: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        self.gemm(dx, dy, w, (m, k, n), (false, false), acc);
    }

    fn linear_bwd_weight(&self, dw: &mut DevBuf<f32>, dy: &DevBuf<f32>, x: &DevBuf<f32>, m: usize, n: usize, k: usize, acc: bool) {
        self.gemm(dw, dy, x, (n, k, m), (true, false), acc);
    }

    fn rmsnorm_fwd(&self, y: &mut DevBuf<f32>, rstd: &mut DevBuf<f32>, x: &DevBuf<f32>, w: &DevBuf<f32>, d: usize, eps: f64) {
        if x.is_empty() {
            return;
        }
        let n = x.len() / d;
        ok("rmsnorm_fwd", self.gpu().rmsnorm_fwd(y.get_mut(), rstd.get_mut(), x.get(), w.get(), n, d, eps as f32));
    }

    fn rmsnorm_bwd(
        &self,
        dx: &mut DevBuf<f32>,
        dw: &mut DevBuf<f32>,
        dy: &DevBuf<f32>,
        x: &DevBuf<f32>,
        w: &DevBuf<f32>,
        rstd: &DevBuf<f32>,
        d: usize,
        acc: bool,
    ) {
        if x.is_empty() {
            return;
        }
        let n = x.len() / d;
        ok("rmsnorm_bwd", self.gpu().rmsnorm_bwd(dx.get_mut(), dw.get_mut(), dy.get(), x.get(), w.get(), rstd.get(), (n, d), acc));
    }

    fn tokens_to_heads(
        &self,
        dst: &mut DevBuf<f32>,
        src: &DevBuf<f32>,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&DevBuf<f32>, &DevBuf<f32>)>,
    ) {
        if src.is_empty() {
            return;
        }
        let tables = rope.map(|(c, s)| (c.get(), s.get()));
        ok("to_heads", self.gpu().heads_rope(dst.get_mut(), src.get(), tables, (b, s, nh, hd), true));
    }

    fn heads_to_tokens(
        &self,
        dst: &mut DevBuf<f32>,
        src: &DevBuf<f32>,
        b: usize,
        s: usize,
        nh: usize,
        hd: usize,
        rope: Option<(&DevBuf<f32>, &DevBuf<f32>)>,
    ) {
        if src.is_empty() {
            return;
        }
        let tables = rope.map(|(c, s)| (c.get(), s.get()));
        ok("from_heads", self.gpu().heads_rope(dst.get_mut(), src.get(), tables, (b, s, nh, hd), false));
    }

    fn swiglu_fwd(&self, h: &mut DevBuf<f32>, gate: &DevBuf<f32>, up: &DevBuf<f32>) {
        if !h.is_empty() {
            ok("swiglu_fwd", self.gpu().swiglu_fwd(h.get_mut(), gate.get(), up.get()));
        }
    }

    fn swiglu_bwd(&self, dgate: &mut DevBuf<f32>, dup: &mut DevBuf<f32>, dh: &DevBuf<f32>, gate: &DevBuf<f32>, up: &DevBuf<f32>) {
        if !dgate.is_empty() {
            ok("swiglu_bwd", self.gpu().swiglu_bwd(dgate.get_mut(), dup.get_mut(), dh.get(), gate.get(), up.get()));
        }
    }

    fn add_assign(&self, dst: &mut DevBuf<f32>, src: &DevBuf<f32>) {
        if !dst.is_empty() {
            ok("add_assign", self.gpu().add_assign(dst.get_mut(), src.get()));
        }
    }

    fn embed_fwd(&self, x: &mut DevBuf<f32>, table: &DevBuf<f32>, ids: &DevIds, offset: usize, valid: usize, d: usize) {
        if !x.is_empty() {
            ok("embed_fwd", self.gpu().embed_fwd(x.get_mut(), table.get(), ids.ids.get(), (ids.ids.len(), d, offset, valid)));
        }
    }

    fn embed_bwd(&self, dtable: &mut DevBuf<f32>, dx: &DevBuf<f32>, ids: &DevIds, offset: usize, valid: usize, d: usize) {
        if !ids.uniq.is_empty() {
            let groups = (ids.uniq.get(), ids.starts.get(), ids.order.get());
            ok("embed_bwd", self.gpu().embed_bwd(dtable.get_mut(), dx.get(), groups, (d, offset, valid)));
        }
    }

    fn ce_row_max(&self, m: &mut DevBuf<f32>, logits: &DevBuf<f32>, v: usize, valid: usize) {
        if !m.is_empty() {
            let n = m.len();
            ok("ce_row_max", self.gpu().ce_row_max(m.get_mut(), logits.get(), (n, v, valid)));
        }
    }

    fn ce_row_sum_exp(&self, s: &mut DevBuf<f32>, logits: &DevBuf<f32>, m: &DevBuf<f32>, v: usize, valid: usize) {
        if !s.is_empty() {
            let n = s.len();
            ok("ce_row_sum_exp", self.gpu().ce_row_sum_exp(s.get_mut(), logits.get(), m.get(), (n, v, valid)));
        }
    }

    fn ce_target_logit(&self, t: &mut DevBuf<f32>, logits: &DevBuf<f32>, targets: &DevIds, v: usize, offset: usize, valid: usize) {
        if !t.is_empty() {
            let n = t.len();
            ok("ce_target_logit", self.gpu().ce_target_logit(t.get_mut(), logits.get(), targets.ids.get(), (n, v, offset, valid)));
        }
    }

    fn ce_finish(&self, lse: &mut DevBuf<f32>, m: &DevBuf<f32>, t: &DevBuf<f32>) -> f64 {
        if lse.is_empty() {
            return 0.0;
        }
        ok("ce_finish", self.gpu().ce_finish(lse.get_mut(), m.get()));
        // Summed on the host in row order from the f32 row losses, as the CPU does.
        let (l, t) = (ok("copy", self.gpu().download(lse.get())), ok("copy", self.gpu().download(t.get())));
        l.iter().zip(&t).map(|(&a, &b)| (a - b) as f64).sum()
    }

    fn ce_bwd_inplace(
        &self,
        logits: &mut DevBuf<f32>,
        lse: &DevBuf<f32>,
        targets: &DevIds,
        v: usize,
        offset: usize,
        valid: usize,
        scale: f32,
    ) {
        if !lse.is_empty() {
            ok("ce_bwd", self.gpu().ce_bwd_inplace(logits.get_mut(), lse.get(), targets.ids.get(), (lse.len(), v, offset, valid), scale));
        }
    }

    /// Per chunk of (batch, kv head) groups: `S = Q·Kᵀ` (batched GEMM, the group's query
    /// heads stacked as rows), the causal softmax in place with its log-sum-exp, `O = P·V`.
    /// The products follow the precision: f32, or TF32 tensor-core products under bf16.
    fn attention_fwd(
        &self,
        o: &mut DevBuf<f32>,
        lse: &mut DevBuf<f32>,
        q: &DevBuf<f32>,
        k: &DevBuf<f32>,
        v: &DevBuf<f32>,
        q_pos: &DevBuf<i32>,
        k_pos: &DevBuf<i32>,
        dm: AttnDims,
    ) {
        if q.is_empty() {
            return;
        }
        let p = AttnPlan::new(dm);
        let tf32 = self.precision == Precision::Bf16;
        let g = self.gpu();
        let mut s = self.scratch(&self.shared.scores, p.chunk * p.s_block);
        for (g0, n) in p.chunks() {
            let batch = |a: usize, b: usize, c: usize| (n, (a, b, c));
            let (qa, ka, va) =
                (Operand::F32(q.get(), g0 * p.q_block), Operand::F32(k.get(), g0 * p.k_block), Operand::F32(v.get(), g0 * p.k_block));
            ok(
                "attention QKᵀ",
                g.gemm_batched(
                    (s.get_mut(), 0),
                    qa,
                    ka,
                    (p.rows, p.sk, p.hd),
                    (false, true),
                    0.0,
                    batch(p.q_block, p.k_block, p.s_block),
                    tf32,
                ),
            );
            let rows = (n * p.rows, g0 * p.rows, p.sq, p.sk);
            ok("attention softmax", g.attn_softmax(s.get_mut(), lse.get_mut(), (q_pos.get(), k_pos.get()), rows, p.scale));
            let sa = Operand::F32(s.get(), 0);
            ok(
                "attention PV",
                g.gemm_batched(
                    (o.get_mut(), g0 * p.q_block),
                    sa,
                    va,
                    (p.rows, p.hd, p.sk),
                    (false, false),
                    0.0,
                    batch(p.s_block, p.k_block, p.q_block),
                    tf32,
                ),
            );
        }
    }

    /// Per chunk: the probabilities again from `S = Q·Kᵀ` and the saved log-sum-exp,
    /// `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = scale·P∘(dP − rowsum(dO∘O))`, `dQ = dS·K`,
    /// `dK = dSᵀ·Q` (the sums over a group's query heads are the GEMMs' own).
    fn attention_bwd(
        &self,
        dq: &mut DevBuf<f32>,
        dk: &mut DevBuf<f32>,
        dv: &mut DevBuf<f32>,
        d_o: &DevBuf<f32>,
        q: &DevBuf<f32>,
        k: &DevBuf<f32>,
        v: &DevBuf<f32>,
        o: &DevBuf<f32>,
        lse: &DevBuf<f32>,
        q_pos: &DevBuf<i32>,
        k_pos: &DevBuf<i32>,
        dm: AttnDims,
    ) {
        if q.is_empty() {
            return;
        }
        let p = AttnPlan::new(dm);
        let tf32 = self.precision == Precision::Bf16;
        let g = self.gpu();
        let mut dd = self.scratch(&self.shared.rowdot, lse.len());
        ok("attention rowsum(dO∘O)", g.attn_rowdot(dd.get_mut(), d_o.get(), o.get(), (lse.len(), p.hd)));
        let mut s = self.scratch(&self.shared.scores, p.chunk * p.s_block);
        let mut ds = self.scratch(&self.shared.dscores, p.chunk * p.s_block);
        for (g0, n) in p.chunks() {
            let batch = |a: usize, b: usize, c: usize| (n, (a, b, c));
            let (qo, ko, vo) = (g0 * p.q_block, g0 * p.k_block, g0 * p.k_block);
            let (qa, ka, va, doa) =
                (Operand::F32(q.get(), qo), Operand::F32(k.get(), ko), Operand::F32(v.get(), vo), Operand::F32(d_o.get(), qo));
            ok(
                "attention QKᵀ",
                g.gemm_batched(
                    (s.get_mut(), 0),
                    qa,
                    ka,
                    (p.rows, p.sk, p.hd),
                    (false, true),
                    0.0,
                    batch(p.q_block, p.k_block, p.s_block),
                    tf32,
                ),
            );
            let rows = (n * p.rows, g0 * p.rows, p.sq, p.sk);
            ok("attention probabilities", g.attn_probs(s.get_mut(), lse.get(), (q_pos.get(), k_pos.get()), rows, p.scale));
            let pa = Operand::F32(s.get(), 0);
            ok(
                "attention dV",
                g.gemm_batched(
                    (dv.get_mut(), vo),
                    pa,
                    doa,
                    (p.sk, p.hd, p.rows),
                    (true, false),
                    0.0,
                    batch(p.s_block, p.q_block, p.k_block),
                    tf32,
                ),
            );
            ok(
                "attention dP",
                g.gemm_batched(
                    (ds.get_mut(), 0),
                    doa,
                    va,
                    (p.rows, p.sk, p.hd),
                    (false, true),
                    0.0,
                    batch(p.q_block, p.k_block, p.s_block),
                    tf32,
                ),
            );
            ok("attention dS", g.attn_dscores(ds.get_mut(), s.get(), dd.get(), (n * p.rows, g0 * p.rows, p.sk), p.scale));
            let dsa = Operand::F32(ds.get(), 0);
            ok(
                "attention dQ",
                g.gemm_batched(
                    (dq.get_mut(), qo),
                    dsa,
                    ka,
                    (p.rows, p.hd, p.sk),
                    (false, false),
                    0.0,
                    batch(p.s_block, p.k_block, p.q_block),
                    tf32,
                ),
            );
            ok(
                "attention dK",
                g.gemm_batched(
                    (dk.get_mut(), ko),
                    dsa,
                    qa,
                    (p.sk, p.hd, p.rows),
                    (true, false),
                    0.0,
                    batch(p.s_block, p.q_block, p.k_block),
                    tf32,
                ),
            );
        }
    }

    fn attention_merge(&self, o: &mut DevBuf<f32>, lse: &mut DevBuf<f32>, o_part: &DevBuf<f32>, lse_part: &DevBuf<f32>, hd: usize) {
        if !lse.is_empty() {
            ok("attention_merge", self.gpu().attn_merge(o.get_mut(), lse.get_mut(), o_part.get(), lse_part.get(), hd));
        }
    }

    fn sum_sq(&self, x: &DevBuf<f32>) -> f64 {
        match x.0.as_ref() {
            None => 0.0,
            Some(x) => ok("sum_sq", self.gpu().sum_sq(x, self.shared.partials.borrow_mut().get_mut())),
        }
    }

    fn scale(&self, x: &mut DevBuf<f32>, c: f32) {
        if let Some(x) = x.0.as_mut() {
            ok("scale", self.gpu().scale(x, c));
        }
    }

    fn adamw(&self, p: &mut DevBuf<f32>, m: &mut DevBuf<f32>, v: &mut DevBuf<f32>, g: &DevBuf<f32>, step: &AdamStep) {
        if !p.is_empty() {
            ok("adamw", self.gpu().adamw(p.get_mut(), m.get_mut(), v.get_mut(), g.get(), step));
        }
    }
}
