#include "model/scripted_load.hpp"

#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>

#include "base/printable.hpp"

namespace dtactor {

namespace {

// The whole file, mapped private: pages are read when touched, and a
// write (a buffer updated in training) copies its page.
struct mapping {
  uint8_t* base = nullptr;
  size_t size = 0;
  ~mapping() {
    if (base) ::munmap(base, size);
  }
};

result<std::shared_ptr<mapping>> map_file(const std::string& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error(std::string("cannot open it: ") + std::strerror(errno));
  struct stat st {};
  auto m = std::make_shared<mapping>();
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    m->size = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    m->base = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  const int err = errno;
  ::close(fd);
  if (!m->base) return make_error(std::string("cannot map it: ") + std::strerror(err));
  return m;
}

uint16_t u16_at(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// Whether the zip entry whose data starts at `data` is stored as it is
// (method 0): its local header (signature, then name and extra field
// lengths that end exactly at `data`) says so.
bool stored_as_is(const mapping& m, size_t data) {
  constexpr size_t header = 30;
  for (size_t back = header; back <= header + 2 * 65535 && back <= data; ++back) {
    const uint8_t* p = m.base + data - back;
    if (std::memcmp(p, "PK\x03\x04", 4) != 0) continue;
    if (header + u16_at(p + 26) + u16_at(p + 28) == back) return u16_at(p + 8) == 0;
  }
  return false;
}

// Every tensor reachable from `v` (objects' slots, containers).
void each_tensor(const c10::IValue& v, const std::function<void(const at::Tensor&)>& f) {
  if (v.isTensor()) return f(v.toTensor());
  if (v.isObject()) {
    const auto obj = v.toObject();
    for (size_t i = 0; i < obj->slots().size(); ++i) each_tensor(obj->getSlot(i), f);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) each_tensor(e, f);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) each_tensor(e, f);
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) each_tensor(e.value(), f);
  }
}

// The module's data unpickled with the classes the code load made, each
// tensor's storage a view of the mapping.
c10::IValue unpickle_data(caffe2::serialize::PyTorchStreamReader& reader, const std::shared_ptr<torch::jit::CompilationUnit>& cu,
                          const std::shared_ptr<mapping>& m, bool& compressed) {
  auto [pickle, size] = reader.getRecord("data.pkl");
  size_t at = 0;
  auto read = [&, data = static_cast<const char*>(pickle.get()), size = size](char* buf, size_t n) {
    n = std::min(n, size - at);
    std::memcpy(buf, data + at, n);
    at += n;
    return n;
  };
  // A class of the code, or a type tag of a container (List[str]).
  auto types = [&](const c10::QualifiedName& name) {
    c10::TypePtr type = cu->get_type(name);
    if (!type) type = torch::jit::Unpickler::defaultTypeParser(name.qualifiedName());
    return c10::StrongTypePtr(cu, type);
  };
  auto objects = [](const at::StrongTypePtr& type, c10::IValue state) {
    auto cls = type.type_->expect<c10::ClassType>();
    const size_t n = cls->numAttributes();
    auto dict = std::move(state).toGenericDict();
    auto obj = c10::ivalue::Object::create(type, n);
    for (size_t i = 0; i < n; ++i) obj->setSlot(i, dict.at(cls->getAttributeName(i)));
    return obj;
  };
  auto records = [&](const std::string& key) {
    const size_t offset = reader.getRecordOffset("data/" + key);
    TORCH_CHECK(offset < m->size, "the record of tensor ", key, " lies outside the file");
    if (!stored_as_is(*m, offset)) compressed = true;
    auto* keep = new std::shared_ptr<mapping>(m);
    return at::DataPtr(m->base + offset, keep, [](void* ctx) { delete static_cast<std::shared_ptr<mapping>*>(ctx); }, at::kCPU);
  };
  torch::jit::Unpickler unpickler(read, types, objects, records, c10::Device(c10::kCPU));
  unpickler.set_version(reader.version());
  return unpickler.parse_ivalue();
}

// Every tensor attribute but the trained parameters copied out of the
// file (buffers, frozen parameters, other tensors): the module no longer
// reads the mapping once the optimizer took the trained parameters in, so
// a model.file rewritten later cannot pull pages from under it.
void copy_out_but_trained(const torch::jit::Module& module) {
  for (const auto& m : module.modules()) {
    const auto type = m.type();
    auto obj = m._ivalue();
    for (size_t i = 0; i < type->numAttributes(); ++i) {
      const c10::IValue v = obj->getSlot(i);
      if (!v.isTensor() || (type->is_parameter(i) && v.toTensor().requires_grad())) continue;
      obj->setSlot(i, v.toTensor().detach().clone());
    }
  }
}

// A class restoring itself (__setstate__) needs LibTorch's own loader.
bool restores_itself(const torch::jit::Module& m) {
  for (const auto& sub : m.modules())
    if (sub.type()->findMethod("__setstate__")) return true;
  return false;
}

}  // namespace

result<std::optional<torch::jit::Module>> load_mapped(const std::string& file) {
  const std::string what = "model.file '" + printable(file, 0) + "': ";
  try {
    caffe2::serialize::PyTorchStreamReader reader(file);
    for (const auto& r : reader.getAllRecords())
      if (r.find("constants/") != std::string::npos) return std::optional<torch::jit::Module>();
    // The code and the classes, every tensor on the meta device.
    torch::jit::Module code = torch::jit::load(file, c10::Device(c10::kMeta));
    if (restores_itself(code)) return std::optional<torch::jit::Module>();
    auto m = map_file(file);
    if (!m) return make_error(what + m.message());
    bool compressed = false;
    c10::IValue data = unpickle_data(reader, code.type()->compilation_unit(), m.value(), compressed);
    if (compressed) return std::optional<torch::jit::Module>();
    if (!data.isObject()) return make_error(what + "its data is not a module");
    std::string outside;
    each_tensor(data, [&](const at::Tensor& t) {
      const auto* p = static_cast<const uint8_t*>(t.storage().data());
      if (t.storage().nbytes() > 0 && (p < m.value()->base || p + t.storage().nbytes() > m.value()->base + m.value()->size)) outside = "a tensor's bytes run past the end of the file";
    });
    if (!outside.empty()) return make_error(what + outside);
    torch::jit::Module out(data.toObject());
    copy_out_but_trained(out);
    return std::optional<torch::jit::Module>(std::move(out));
  } catch (const c10::Error& e) {
    const std::string why = e.what_without_backtrace();
    return make_error(what + "is not a TorchScript file dtactor can read: " + printable(why.substr(0, why.find('\n'))));
  } catch (const std::exception& e) {
    const std::string why = e.what();
    return make_error(what + "is not a TorchScript file dtactor can read: " + printable(why.substr(0, why.find('\n'))));
  }
}

}  // namespace dtactor
