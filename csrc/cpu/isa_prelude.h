// What the per-ISA translation units (isa_*.cpp) include before their #pragma GCC target: the
// standard library and every megalign header the vector kernels use, so all of it is compiled for
// the baseline target in every unit and no inline function outside the ISA's own namespace can
// carry instructions of a wider ISA into code that runs on a CPU without it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "kl_policy_cpu.h"
#include "megalign/common.h"
#include "megalign/kl_penalty.h"
#include "megalign/kl_policy_common.h"
#include "megalign/math/exp.h"
#include "megalign/math/kl.h"
#include "megalign/math/policy.h"
#include "megalign/math/token_logprob.h"
#include "megalign/policy_loss.h"
#include "megalign/token_logprob.h"
#include "token_logprob_rows.h"
