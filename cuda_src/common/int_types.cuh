// Fixed-width integer names shared by host-visible structs and device code (plain C++: the
// parameter structs that use them also compile on the host for the layout check).
#pragma once

namespace cuattn {

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

}  // namespace cuattn
