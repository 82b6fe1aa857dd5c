// Fused cross-entropy throughput: times kernels::fused_xent (CPU twin, or CUDA with --device cuda)
// on seeded [rows x vocab] logits, best of N, against a memory copy of the same logits buffer in
// the same process (threaded like the kernel). The kernel must read the logits and write a gradient
// of the same size, exactly the copy's traffic, so kernel_vs_copy is how far it is from the
// memory-traffic limit.
//   xent_throughput [--rows R] [--vocab V] [--dtype float32|bfloat16|float16] [--repeats N]
//   [--device cpu|cuda]
//                   [--logits FILE --targets FILE]   (raw row-major logits in --dtype, raw int64
//                   targets:
//                                                     bench/xent_bench.py hands PyTorch's inputs
//                                                     over this way)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/cpu/fused_xent_rows.h"
#include "kernels/cpu/parallel.h"
#include "kernels/device_buffer.h"
#include "kernels/fused_xent.h"
#include "synth/cases.h"

using Clock = std::chrono::steady_clock;
using namespace lossguard;

int main(int argc, char** argv) {
  int64_t rows = 8192, vocab = 32768;
  int repeats = 5;
  std::string dtype_s = "float32", device_s = "cpu", logits_path, targets_path;
  for (int k = 1; k + 1 < argc; k += 2) {
    const std::string f = argv[k], v = argv[k + 1];
    if (f == "--rows")
      rows = std::stoll(v);
    else if (f == "--vocab")
      vocab = std::stoll(v);
    else if (f == "--dtype")
      dtype_s = v;
    else if (f == "--repeats")
      repeats = std::stoi(v);
    else if (f == "--device")
      device_s = v;
    else if (f == "--logits")
      logits_path = v;
    else if (f == "--targets")
      targets_path = v;
    else {
      std::cerr << "unknown option " << f << "\n";
      return 2;
    }
  }
  DType dtype;
  kernels::Device device;
  if (!parse_dtype(dtype_s, &dtype) || !parse_mode(device_s, &device)) {
    std::cerr << "bad --dtype or --device\n";
    return 2;
  }
  const std::size_t elem = dtype_size_bytes(dtype), n = static_cast<std::size_t>(rows * vocab),
                    bytes = n * elem;
  // Seeded logits, uniform in [-4, 4): a cheap LCG per thread range (the generator is not what is
  // measured).
  kernels::DeviceBuffer host_logits(kernels::Device::kCpu, bytes);
  std::vector<int64_t> targets(static_cast<std::size_t>(rows));
  auto read_raw = [](const std::string& path, void* dst, std::size_t n) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    const bool ok = f != nullptr && std::fread(dst, 1, n, f) == n;
    if (f != nullptr) std::fclose(f);
    if (!ok) {
      std::cerr << "xent_throughput: cannot read " << n << " bytes from " << path << "\n";
      std::exit(2);
    }
  };
  if (!logits_path.empty()) {
    read_raw(logits_path, host_logits.data(), bytes);
    read_raw(targets_path, targets.data(), targets.size() * sizeof(int64_t));
  } else {
    kernels::parallel_ranges(static_cast<int64_t>(n), 1 << 20, [&](int64_t b, int64_t e, int) {
      uint64_t s = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(b + 1);
      for (int64_t k = b; k < e; ++k) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const float x = (static_cast<float>(s >> 40) / 16777216.0f - 0.5f) * 8.0f;
        if (dtype == DType::kFloat32)
          host_logits.as<float>()[k] = x;
        else
          host_logits.as<uint16_t>()[k] =
              dtype == DType::kFloat16 ? float_to_half(x) : float_to_bfloat16(x);
      }
    });
    synth::Rng rng(7);
    for (auto& t : targets) t = rng.uniform_int(0, vocab - 1);
  }
  std::vector<float> scale(static_cast<std::size_t>(rows), 1.0f / static_cast<float>(rows));

  kernels::DeviceBuffer logits(device, bytes), grad(device, bytes), copy_dst(device, bytes);
  kernels::DeviceBuffer d_targets(device, rows * 8), d_scale(device, rows * 4),
      d_lse(device, rows * 4), d_loss(device, rows * 4);
  logits.upload(host_logits.data(), bytes);
  d_targets.upload(targets.data(), rows * 8);
  d_scale.upload(scale.data(), rows * 4);
  grad.zero();  // first touch outside the timed region, as a trainer reusing its gradient buffer
  copy_dst.zero();

  auto best_of = [&](auto&& fn) {
    double best = 1e30;
    for (int k = 0; k < repeats; ++k) {
      const auto a = Clock::now();
      fn();
      if (device == kernels::Device::kCuda) kernels::cuda_synchronize();
      best = std::min(best, std::chrono::duration<double>(Clock::now() - a).count());
    }
    return best;
  };
  const double copy_s = best_of([&] {
    if (device == kernels::Device::kCuda) {
      kernels::cuda_copy_device(copy_dst.data(), logits.data(), bytes);
    } else {
      kernels::parallel_ranges(
          static_cast<int64_t>(bytes), 1 << 22, [&](int64_t b, int64_t e, int) {
            std::memcpy(copy_dst.as<std::byte>() + b, logits.as<std::byte>() + b,
                        static_cast<std::size_t>(e - b));
          });
    }
  });
  kernels::XentArgs a;
  a.logits = logits.data();
  a.dtype = dtype;
  a.rows = rows;
  a.vocab = vocab;
  a.row_stride = vocab;
  a.targets = d_targets.as<int64_t>();
  a.grad_scale = d_scale.as<float>();
  a.lse = d_lse.as<float>();
  a.token_loss = d_loss.as<float>();
  a.grad = grad.data();
  const double xent_s = best_of([&] { kernels::fused_xent(a, device); });
  std::vector<float> loss(static_cast<std::size_t>(rows));
  d_loss.download(loss.data(), rows * 4);
  double loss_sum = 0;  // sum_r c_r l_r with c_r = 1 / rows: the mean token loss
  for (std::size_t r = 0; r < loss.size(); ++r) loss_sum += static_cast<double>(scale[r]) * loss[r];
  const double traffic =
      2.0 * static_cast<double>(bytes);  // read logits + write gradient (= a copy's)
  nlohmann::json j = {{"rows", rows},
                      {"vocab", vocab},
                      {"dtype", dtype_s},
                      {"device", device_s},
                      {"isa", device == kernels::Device::kCpu ? kernels::xent_cpu_isa() : "cuda"},
                      {"threads", kernels::cpu_threads()},
                      {"repeats", repeats},
                      {"fused_xent_s", xent_s},
                      {"copy_s", copy_s},
                      {"fused_xent_traffic_bytes_per_s", traffic / xent_s},
                      {"copy_traffic_bytes_per_s", traffic / copy_s},
                      {"kernel_vs_copy", xent_s / copy_s},
                      {"loss", loss_sum}};
  std::cout << j.dump() << "\n";
  return 0;
}
