// The emulator's device memory that the host cannot read (cuda_emu.h, "Device memory the host
// cannot read") as plain functions for the torch side of the backend (backend.cpp), which must not
// include the emulator header.
#include "emu/cuda_emu.h"

#include <sys/mman.h>

#include <new>

namespace paged {

// bytes rounded up to whole pages, mapped fresh (zero-filled), registered as device memory.
void* emu_device_alloc(size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t mapped = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  cuda_emu::register_device_region(p, mapped);
  return p;
}
void emu_device_free(void* p, size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  cuda_emu::unregister_device_region(p);
  munmap(p, (bytes + page - 1) / page * page);
}
void emu_close_device_memory(bool closed) { cuda_emu::close_device_memory(closed); }
bool emu_in_device_memory(const void* p) { return cuda_emu::in_device_memory(p); }
void emu_device_copy(void* dst, const void* src, size_t bytes) { cuda_emu::device_copy(dst, src, bytes); }

}  // namespace paged
