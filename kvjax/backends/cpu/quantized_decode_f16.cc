// The KIVI decode kernel for Half scales and zeros (see quantized_kernel.h).

#include "quantized_kernel.h"

namespace kvjax {
template void quant_dispatch<Half>(const QuantArgs&, int64_t, int64_t);
}  // namespace kvjax
