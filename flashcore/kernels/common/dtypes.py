"""The DSL element types behind a spec's dtype names (every kernel of the package uses these)."""

import cutlass

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
E4M3 = cutlass.Float8E4M3FN
