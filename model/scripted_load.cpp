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

// The file a load mapped, kept open, and what it was when loaded.
struct mapped_source {
  int fd = -1;
  std::string name;  // printable
  off_t size = 0;
  struct timespec mtime {};
  ~mapped_source() {
    if (fd >= 0) ::close(fd);
  }
};

namespace {

// The whole file, mapped private: pages are read when touched, and a
// write (a buffer updated in training) copies its page.
struct mapping {
  uint8_t* base = nullptr;
  size_t size = 0;
  std::shared_ptr<mapped_source> src;
  ~mapping() {
    if (base) ::munmap(base, size);
  }
};

result<std::shared_ptr<mapping>> map_file(const std::string& file) {
  auto src = std::make_shared<mapped_source>();
  src->name = printable(file, 0);
  src->fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (src->fd < 0) return make_error(std::string("cannot open it: ") + std::strerror(errno));
  struct stat st {};
  auto m = std::make_shared<mapping>();
  if (::fstat(src->fd, &st) == 0 && st.st_size > 0) {
    src->size = st.st_size;
    src->mtime = st.st_mtim;
    m->size = static_cast<size_t>(st.st_size);
    void* p = ::mmap(nullptr, m->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, src->fd, 0);
    m->base = p == MAP_FAILED ? nullptr : static_cast<uint8_t*>(p);
  }
  if (!m->base) return make_error(std::string("cannot map it: ") + std::strerror(errno));
  m->src = std::move(src);
  return m;
}

// The deleter of a tensor's storage that is a view of a mapping.
void release_view(void* ctx) { delete static_cast<std::shared_ptr<mapping>*>(ctx); }

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
    return at::DataPtr(m->base + offset, keep, &release_view, at::kCPU);
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

std::optional<file_values> file_values::of(const torch::Tensor& t) {
  const auto& data = t.storage().data_ptr();
  const bool empty = t.storage().nbytes() == 0;
  if (!empty && data.get_deleter() != &release_view) return std::nullopt;
  file_values v;
  if (!empty) {
    const auto& m = *static_cast<const std::shared_ptr<mapping>*>(data.get_context());
    v.src_ = m->src;
    v.offset_ = static_cast<const uint8_t*>(data.get()) - m->base;
    v.nbytes_ = static_cast<int64_t>(t.storage().nbytes());
  }
  v.dtype_ = t.scalar_type();
  v.sizes_ = t.sizes().vec();
  v.strides_ = t.strides().vec();
  v.storage_offset_ = t.storage_offset();
  return v;
}

result<torch::Tensor> file_values::read() const {
  if (!src_) return torch::empty_strided(sizes_, strides_, torch::TensorOptions().dtype(dtype_));
  const std::string what = "model.file '" + src_->name + "' ";
  struct stat st {};
  if (::fstat(src_->fd, &st) != 0) return make_error(what + "cannot be read again: " + std::strerror(errno));
  if (st.st_size != src_->size || st.st_mtim.tv_sec != src_->mtime.tv_sec || st.st_mtim.tv_nsec != src_->mtime.tv_nsec)
    return make_error(what + "was changed in place since it was loaded (its size or modification time differ); "
                             "replace a model file by renaming a new one over it, not by writing into it");
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype_));
  auto flat = torch::empty({(nbytes_ + item - 1) / item}, torch::TensorOptions().dtype(dtype_));
  auto* out = static_cast<char*>(flat.data_ptr());
  for (int64_t done = 0; done < nbytes_;) {
    const ssize_t n = ::pread(src_->fd, out + done, static_cast<size_t>(nbytes_ - done), offset_ + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return make_error(what + (n < 0 ? std::string("cannot be read again: ") + std::strerror(errno) : "ends before a tensor's values (it was truncated since it was loaded)"));
    done += n;
  }
  return flat.as_strided(sizes_, strides_, storage_offset_);
}

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
