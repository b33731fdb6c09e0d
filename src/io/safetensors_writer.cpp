#include "io/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace focus::io {

void write_file_atomic(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(tmp, ": cannot create: ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      fail(tmp, ": write failed: ", std::strerror(e));
    }
    done += (size_t)w;
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) fail(tmp, ": cannot flush to disk: ", std::strerror(errno));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail(path, ": cannot rename from ", tmp, ": ", std::strerror(errno));
}

void save_safetensors(const std::string& path, const std::map<std::string, F32Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  size_t off = 0;
  for (const auto& [name, t] : tensors) {
    int64_t n = 1;
    for (auto d : t.shape) n *= d;
    FOCUS_CHECK(n == (int64_t)t.data.size(), path, ": tensor '", name, "' has ", t.data.size(),
                " values for its shape");
    h[name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {off, off + t.data.size() * 4}}};
    off += t.data.size() * 4;
  }
  std::string js = h.dump();
  while ((8 + js.size()) % 8) js.push_back(' ');  // data section 8-byte aligned
  std::string out;
  const uint64_t hl = js.size();
  out.append(reinterpret_cast<const char*>(&hl), 8);
  out += js;
  for (const auto& [name, t] : tensors) out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * 4);
  write_file_atomic(path, out);
}

}  // namespace focus::io
