// A device guard for CUDA in a CPU-only build of torch (tests/fakecuda.py loads it; never on a CUDA build).
//
// Code that switches devices before dispatching (indexing, factory functions, copies) asks c10 for the guard of
// the device type and fails with "PyTorch is not linked with support for cuda devices" when there is none. This
// one only remembers the current device index per thread: no memory, streams or kernels, which the Python side
// of the fake (a dispatch mode over CPU or meta tensors) stands in for.
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

thread_local c10::DeviceIndex current_index = 0;

struct FakeCudaGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }

  c10::Device getDevice() const override { return c10::Device(c10::DeviceType::CUDA, current_index); }

  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) current_index = d.index();
  }

  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_index = d.index();
  }

  c10::Stream getStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }

  c10::Stream exchangeStream(c10::Stream s) const override { return c10::Stream(c10::Stream::DEFAULT, s.device()); }

  c10::DeviceIndex deviceCount() const noexcept override { return 8; }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
