//! One launch wrapper per kernel of `kernels.cu`: each checks the buffers against the sizes it
//! passes (the kernels index by them) and names the host kernel whose contract it implements.

use super::{dw_tiles, elementwise, need, per_row, warp_per_row, Gpu, BLOCK, DW_TILE_ROWS};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

impl Gpu {
    /// RMSNorm forward of `n` rows of `d` (`cpu::kernels::rmsnorm_fwd`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        y: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        n: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), String> {
        need("rmsnorm_fwd", y.len() >= n * d && x.len() >= n * d && rstd.len() >= n && w.len() >= d)?;
        let (n32, d32) = (n as i32, d as i32);
        let mut l = self.launcher("rmsnorm_fwd");
        l.arg(y).arg(rstd).arg(x).arg(w).arg(&n32).arg(&d32).arg(&eps);
        Self::launch("rmsnorm_fwd", l, per_row(n))
    }

    /// RMSNorm backward (`cpu::kernels::rmsnorm_bwd`): `dx` overwritten or accumulated,
    /// `dw +=` always.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        (dx, dw, partial): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
        dy: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        (n, d): (usize, usize),
        accumulate: bool,
    ) -> Result<(), String> {
        let tiles = dw_tiles(n);
        need(
            "rmsnorm_bwd",
            dx.len() >= n * d && dy.len() >= n * d && x.len() >= n * d && rstd.len() >= n && w.len() >= d && dw.len() >= d,
        )?;
        need("rmsnorm_bwd (the weight gradient's partial sums)", partial.len() >= tiles * d)?;
        let (n32, d32, acc) = (n as i32, d as i32, accumulate as i32);
        let mut l = self.launcher("rmsnorm_bwd_dx");
        l.arg(&mut *dx).arg(dy).arg(x).arg(w).arg(rstd).arg(&n32).arg(&d32).arg(&acc);
        Self::launch("rmsnorm_bwd_dx", l, per_row(n))?;
        let (tiles32, tile32) = (tiles as i32, DW_TILE_ROWS as i32);
        let mut l = self.launcher("rmsnorm_bwd_dw_partial");
        l.arg(&mut *partial).arg(dy).arg(x).arg(rstd).arg(&n32).arg(&d32).arg(&tile32);
        let mut grid = elementwise(d);
        grid.grid_dim.1 = tiles as u32;
        Self::launch("rmsnorm_bwd_dw_partial", l, grid)?;
        let mut l = self.launcher("rmsnorm_bwd_dw_sum");
        l.arg(dw).arg(&*partial).arg(&tiles32).arg(&d32);
        Self::launch("rmsnorm_bwd_dw_sum", l, elementwise(d))
    }

    /// Token-major `[B, S, nh·hd]` → head-major `[B, nh, S, hd]`, RoPE-rotated when tables are
    /// given (`cpu::kernels::to_heads_rope`); `forward = false` is the backward
    /// (`from_heads_rope`: head-major gradient → token-major).
    #[allow(clippy::too_many_arguments)]
    pub fn heads_rope(
        &self,
        dst: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        tables: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        (b, s, nh, hd): (usize, usize, usize, usize),
        forward: bool,
    ) -> Result<(), String> {
        let n = b * s * nh * hd;
        let half = hd / 2;
        need("heads_rope", dst.len() >= n && src.len() >= n && tables.is_none_or(|(c, sn)| c.len() >= s * half && sn.len() >= s * half))?;
        let name = if forward { "to_heads_rope" } else { "from_heads_rope" };
        // Without rotation the tables are not read; any buffer stands in for them.
        let (cos, sin) = tables.unwrap_or((src, src));
        let (b32, s32, nh32, hd32, rotate) = (b as i32, s as i32, nh as i32, hd as i32, tables.is_some() as i32);
        let mut l = self.launcher(name);
        l.arg(dst).arg(src).arg(cos).arg(sin).arg(&b32).arg(&s32).arg(&nh32).arg(&hd32).arg(&rotate);
        Self::launch(name, l, elementwise(n))
    }

    pub fn swiglu_fwd(&self, h: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, up: &CudaSlice<f32>) -> Result<(), String> {
        need("swiglu_fwd", gate.len() >= h.len() && up.len() >= h.len())?;
        let n = h.len() as i64;
        let mut l = self.launcher("swiglu_fwd");
        l.arg(h).arg(gate).arg(up).arg(&n);
        Self::launch("swiglu_fwd", l, elementwise(n as usize))
    }

    pub fn swiglu_bwd(
        &self,
        dgate: &mut CudaSlice<f32>,
        dup: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
    ) -> Result<(), String> {
        let n = dgate.len();
        need("swiglu_bwd", dup.len() >= n && dh.len() >= n && gate.len() >= n && up.len() >= n)?;
        let n64 = n as i64;
        let mut l = self.launcher("swiglu_bwd");
        l.arg(dgate).arg(dup).arg(dh).arg(gate).arg(up).arg(&n64);
        Self::launch("swiglu_bwd", l, elementwise(n))
    }

    /// `dst += src` (the residual adds, and a reduced shard added into another).
    pub fn add_assign(&self, dst: &mut CudaViewMut<'_, f32>, src: &CudaView<'_, f32>) -> Result<(), String> {
        need("add_assign", src.len() >= dst.len())?;
        let n = dst.len() as i64;
        let mut l = self.launcher("add_assign");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("add_assign", l, elementwise(n as usize))
    }

    /// Each row's maximum over its first `valid` columns (`cpu::kernels::row_max`).
    pub fn ce_row_max(&self, m: &mut CudaSlice<f32>, logits: &CudaSlice<f32>, (n, v, valid): (usize, usize, usize)) -> Result<(), String> {
        need("ce_row_max", logits.len() >= n * v && m.len() >= n && valid <= v)?;
        let (n32, v32, va32) = (n as i32, v as i32, valid as i32);
        let mut l = self.launcher("ce_row_max");
        l.arg(m).arg(logits).arg(&n32).arg(&v32).arg(&va32);
        Self::launch("ce_row_max", l, per_row(n))
    }

    /// `s = Σ exp(logits − m)` over the valid columns (`cpu::kernels::row_sum_exp`).
    pub fn ce_row_sum_exp(
        &self,
        s: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        m: &CudaSlice<f32>,
        (n, v, valid): (usize, usize, usize),
    ) -> Result<(), String> {
        need("ce_row_sum_exp", logits.len() >= n * v && m.len() >= n && s.len() >= n && valid <= v)?;
        let (n32, v32, va32) = (n as i32, v as i32, valid as i32);
        let mut l = self.launcher("ce_row_sum_exp");
        l.arg(s).arg(logits).arg(m).arg(&n32).arg(&v32).arg(&va32);
        Self::launch("ce_row_sum_exp", l, per_row(n))
    }

    /// The target's logit where `offset ≤ target < offset + valid`, else 0 (`target_logit`).
    pub fn ce_target_logit(
        &self,
        t: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        (n, v, offset, valid): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        need("ce_target_logit", logits.len() >= n * v && targets.len() >= n && t.len() >= n && valid <= v)?;
        let (n32, v32, o32, va32) = (n as i32, v as i32, offset as i32, valid as i32);
        let mut l = self.launcher("ce_target_logit");
        l.arg(t).arg(logits).arg(targets).arg(&n32).arg(&v32).arg(&o32).arg(&va32);
        Self::launch("ce_target_logit", l, elementwise(n))
    }

    /// In place `lse = m + ln(lse)`.
    pub fn ce_finish(&self, lse: &mut CudaSlice<f32>, m: &CudaSlice<f32>) -> Result<(), String> {
        let n = lse.len();
        need("ce_finish", m.len() >= n)?;
        let n32 = n as i32;
        let mut l = self.launcher("ce_finish");
        l.arg(lse).arg(m).arg(&n32);
        Self::launch("ce_finish", l, elementwise(n))
    }

    /// In place: `logits` become `scale · (softmax − onehot)` (`cross_entropy_bwd_inplace`).
    #[allow(clippy::too_many_arguments)]
    pub fn ce_bwd_inplace(
        &self,
        logits: &mut CudaSlice<f32>,
        lse: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        (n, v, offset, valid): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("ce_bwd_inplace", logits.len() >= n * v && lse.len() >= n && targets.len() >= n && valid <= v)?;
        let (n32, v32, o32, va32) = (n as i32, v as i32, offset as i32, valid as i32);
        let mut l = self.launcher("ce_bwd_inplace");
        l.arg(logits).arg(lse).arg(targets).arg(&n32).arg(&v32).arg(&o32).arg(&va32).arg(&scale);
        Self::launch("ce_bwd_inplace", l, per_row(n))
    }

    /// `rows` rows of scores `[rows, sk]` (rows `row0..` of the attention) become, in place,
    /// the causal softmax of `scale · s`; `lse[row0..]` their log-sum-exps.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_softmax(
        &self,
        s: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        (q_pos, k_pos): (&CudaSlice<i32>, &CudaSlice<i32>),
        (rows, row0, sq, sk): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_softmax", s.len() >= rows * sk && lse.len() >= row0 + rows && q_pos.len() >= sq && k_pos.len() >= sk)?;
        let (sq32, sk32, r0) = (sq as i32, sk as i32, row0 as i64);
        let mut l = self.launcher("attn_softmax");
        l.arg(s).arg(lse).arg(q_pos).arg(k_pos).arg(&sq32).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_softmax", l, per_row(rows))
    }

    /// The backward's probabilities, in place, from the scores and the saved `lse`.
    #[allow(clippy::too_many_arguments)]
    pub fn attn_probs(
        &self,
        s: &mut CudaSlice<f32>,
        lse: &CudaSlice<f32>,
        (q_pos, k_pos): (&CudaSlice<i32>, &CudaSlice<i32>),
        (rows, row0, sq, sk): (usize, usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_probs", s.len() >= rows * sk && lse.len() >= row0 + rows && q_pos.len() >= sq && k_pos.len() >= sk)?;
        let (sq32, sk32, r0) = (sq as i32, sk as i32, row0 as i64);
        let mut l = self.launcher("attn_probs");
        l.arg(s).arg(lse).arg(q_pos).arg(k_pos).arg(&sq32).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_probs", l, per_row(rows))
    }

    /// In place `dp ← scale · p ∘ (dp − dd[row])` over `rows` rows of `sk`.
    pub fn attn_dscores(
        &self,
        dp: &mut CudaSlice<f32>,
        p: &CudaSlice<f32>,
        dd: &CudaSlice<f32>,
        (rows, row0, sk): (usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        need("attn_dscores", dp.len() >= rows * sk && p.len() >= rows * sk && dd.len() >= row0 + rows)?;
        let (sk32, r0) = (sk as i32, row0 as i64);
        let mut l = self.launcher("attn_dscores");
        l.arg(dp).arg(p).arg(dd).arg(&sk32).arg(&r0).arg(&scale);
        Self::launch("attn_dscores", l, per_row(rows))
    }

    /// `dd [rows] = rowsum(d_o ∘ o)` over rows of `hd`.
    pub fn attn_rowdot(
        &self,
        dd: &mut CudaSlice<f32>,
        d_o: &CudaSlice<f32>,
        o: &CudaSlice<f32>,
        (rows, hd): (usize, usize),
    ) -> Result<(), String> {
        need("attn_rowdot", dd.len() >= rows && d_o.len() >= rows * hd && o.len() >= rows * hd)?;
        let (rows64, hd32) = (rows as i64, hd as i32);
        let mut l = self.launcher("attn_bwd_rowdot");
        l.arg(dd).arg(d_o).arg(o).arg(&rows64).arg(&hd32);
        Self::launch("attn_bwd_rowdot", l, warp_per_row(rows))
    }

    /// One AdamW update of one tensor with the coefficients `optim::AdamW` computes.
    pub fn adamw(
        &self,
        p: &mut CudaViewMut<'_, f32>,
        m: &mut CudaViewMut<'_, f32>,
        v: &mut CudaViewMut<'_, f32>,
        g: &CudaView<'_, f32>,
        step: &crate::backend::AdamStep,
    ) -> Result<(), String> {
        let n = p.len();
        need("adamw", m.len() >= n && v.len() >= n && g.len() >= n)?;
        let (decay, b1, b2) = (step.decay as f32, step.b1 as f32, step.b2 as f32);
        let (step_size, bc2_sqrt, eps) = (step.step_size as f32, step.bc2_sqrt as f32, step.eps as f32);
        let n64 = n as i64;
        let mut l = self.launcher("adamw");
        l.arg(p).arg(m).arg(v).arg(g).arg(&n64).arg(&decay).arg(&b1).arg(&b2).arg(&step_size).arg(&bc2_sqrt).arg(&eps);
        Self::launch("adamw", l, elementwise(n))
    }

    /// Online-softmax merge of `(o_part, lse_part)` into `(o, lse)` (`merge_partial`).
    pub fn attn_merge(
        &self,
        o: &mut CudaSlice<f32>,
        lse: &mut CudaSlice<f32>,
        o_part: &CudaSlice<f32>,
        lse_part: &CudaSlice<f32>,
        hd: usize,
    ) -> Result<(), String> {
        let rows = lse.len();
        need("attn_merge", o.len() >= rows * hd && o_part.len() >= rows * hd && lse_part.len() >= rows)?;
        let (rows64, hd32) = (rows as i64, hd as i32);
        let mut l = self.launcher("attn_merge");
        l.arg(o).arg(lse).arg(o_part).arg(lse_part).arg(&rows64).arg(&hd32);
        Self::launch("attn_merge", l, warp_per_row(rows))
    }

    /// `x [n, d] =` the rows `ids − offset` of `table` this rank holds, else 0.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_fwd(
        &self,
        x: &mut CudaSlice<f32>,
        table: &CudaSlice<f32>,
        ids: &CudaSlice<u32>,
        (n, d, offset, valid): (usize, usize, usize, usize),
    ) -> Result<(), String> {
        need("embed_fwd", x.len() >= n * d && ids.len() >= n && table.len() >= valid * d)?;
        let (n64, d32, o32, va32) = (n as i64, d as i32, offset as i32, valid as i32);
        let mut l = self.launcher("embed_fwd");
        l.arg(x).arg(table).arg(ids).arg(&n64).arg(&d32).arg(&o32).arg(&va32);
        Self::launch("embed_fwd", l, elementwise(n * d))
    }

    /// `dtable[uniq[u] − offset] += Σ dx[order[starts[u]..starts[u+1]]]`, in token order.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_bwd(
        &self,
        dtable: &mut CudaSlice<f32>,
        dx: &CudaSlice<f32>,
        (uniq, starts, order): (&CudaSlice<u32>, &CudaSlice<i32>, &CudaSlice<i32>),
        (d, offset, valid): (usize, usize, usize),
    ) -> Result<(), String> {
        let u = uniq.len();
        need("embed_bwd", starts.len() > u && dtable.len() >= valid * d && dx.len() >= order.len() * d)?;
        let (d32, o32, va32) = (d as i32, offset as i32, valid as i32);
        let mut l = self.launcher("embed_bwd");
        l.arg(dtable).arg(dx).arg(uniq).arg(starts).arg(order).arg(&d32).arg(&o32).arg(&va32);
        Self::launch("embed_bwd", l, per_row(u))
    }

    pub fn fill(&self, x: &mut CudaViewMut<'_, f32>, v: f32) -> Result<(), String> {
        let n = x.len() as i64;
        let mut l = self.launcher("fill_f32");
        l.arg(x).arg(&v).arg(&n);
        Self::launch("fill_f32", l, elementwise(n as usize))
    }

    pub fn scale(&self, x: &mut CudaViewMut<'_, f32>, c: f32) -> Result<(), String> {
        let n = x.len() as i64;
        let mut l = self.launcher("scale_f32");
        l.arg(x).arg(&c).arg(&n);
        Self::launch("scale_f32", l, elementwise(n as usize))
    }

    /// `Σ x²` in f64: per-block partials on the GPU, added in block order here.
    pub fn sum_sq(&self, x: &CudaView<'_, f32>, partials: &mut CudaSlice<f64>) -> Result<f64, String> {
        let n = x.len();
        let blocks = partials.len().min(n.div_ceil(BLOCK as usize)).max(1);
        let n64 = n as i64;
        let mut l = self.launcher("sum_sq_partial");
        l.arg(&mut *partials).arg(x).arg(&n64);
        Self::launch("sum_sq_partial", l, LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 })?;
        let host = self.download(partials)?;
        Ok(host[..blocks].iter().sum())
    }

    /// The first `src.len()` elements of `dst` become `src` in bf16 (`dst` may be longer: a
    /// scratch sized for the largest operand).
    pub fn to_bf16(&self, dst: &mut CudaSlice<u16>, src: &CudaSlice<f32>) -> Result<(), String> {
        need("to_bf16", dst.len() >= src.len())?;
        let n = src.len() as i64;
        let mut l = self.launcher("f32_to_bf16");
        l.arg(dst).arg(src).arg(&n);
        Self::launch("f32_to_bf16", l, elementwise(n as usize))
    }
}
