// The host runtime (runtime.hpp): memory from HostBuffer, the reference backend, wall-clock marks.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "host_buffer.hpp"
#include "runtime.hpp"

namespace serving {

namespace {

class HostRuntime final : public Runtime {
 public:
  explicit HostRuntime(int max_marks) : marks_(size_t(max_marks)) {}
  std::string name() const override { return "cpu (reference backend)"; }
  bool is_cuda() const override { return false; }
  flashserve::DeviceProps props() const override { return flashserve::DeviceProps::cpu(); }
  size_t free_bytes() const override { return size_t(sysconf(_SC_AVPHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE)); }

  Buffer alloc(flashserve::DType dtype, std::initializer_list<int64_t> shape) override {
    auto h = std::make_shared<HostBuffer>(dtype, shape);
    return Buffer{std::shared_ptr<void>(h, h->ref().data), h->bytes(), h->ref()};
  }
  void upload(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }

  void fill_qkv(const QkvFill& f) override {
    for (size_t r = 0; r < f.rows.size(); ++r) {
      f.act->fill(Operand::q, f.rows[r], f.layer, f.q, int64_t(r));
      f.act->fill(Operand::k, f.rows[r], f.layer, f.k, int64_t(r));
      f.act->fill(Operand::v, f.rows[r], f.layer, f.v, int64_t(r));
    }
  }

  void mark(int i) override { marks_.at(size_t(i)) = std::chrono::steady_clock::now(); }
  double elapsed_ms(int from, int to) override {
    return std::chrono::duration<double, std::milli>(marks_.at(size_t(to)) - marks_.at(size_t(from))).count();
  }

 private:
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

}  // namespace

std::unique_ptr<Runtime> make_host_runtime(int max_marks) { return std::make_unique<HostRuntime>(max_marks); }

}  // namespace serving
