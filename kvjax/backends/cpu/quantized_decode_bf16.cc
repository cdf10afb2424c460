// The KIVI decode kernel for Bf16 scales and zeros (see quantized_kernel.h).

#include "quantized_kernel.h"

namespace kvjax {
template void quant_dispatch<Bf16>(const QuantArgs&, int64_t, int64_t);
}  // namespace kvjax
