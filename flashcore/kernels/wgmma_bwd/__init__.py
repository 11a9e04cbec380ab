"""The Hopper backward (sm_90): the mma_sync backward's dK/dV-stationary walk with warpgroup
MMAs. Each warpgroup holds 64 of the CTA's keys and computes Sᵀ and dPᵀ (keys x query rows), so
its Pᵀ and dSᵀ are already the A operands, in registers, of dV += Pᵀ·dO and dK += dSᵀ·Q; dSᵀ
goes to shared memory once, for dQ = dS·K."""
