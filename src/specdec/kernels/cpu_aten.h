// The parts of ATen the kernel sources use. Not <torch/types.h>, which declares every ATen
// operator: ~13 s to parse in each source on a 2-core runner, these ~6 s. Each operator a
// source calls needs its <ATen/ops/...> header here, and operators on tensors are spelled as
// methods (a.mul(b), not a * b: <ATen/TensorOperators.h> alone costs ~3 s).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>
