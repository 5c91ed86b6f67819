//! One pool of physical device memory for every sequence's caches and lightning states, through
//! CUDA's virtual memory management: a buffer is a range of virtual addresses into which the
//! pool's pages (the allocation granularity, 2 MiB on current GPUs) are mapped as it grows, and
//! from which they go back to the pool when it is dropped. Kernels see one contiguous range; a
//! buffer that outgrows its addresses maps the same pages into a range twice as large, so its
//! data is never copied; the pages a finished sequence held serve the next one. A buffer may
//! begin with another's pages ([`PagedBuf::share_prefix`]: a prefix-cache hit's keys and
//! values), which then go back to the pool when the last buffer mapping them drops.

use cudarc::driver::sys::{self, CUdeviceptr, CUmemGenericAllocationHandle, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use sala_model::{BResult, BackendError};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

fn check(what: &str, r: CUresult) -> BResult<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError(format!("CUDA {what}: {r:?}")))
    }
}

fn location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

/// The physical pages: those free for reuse, and how many exist, up to `limit`.
pub struct PagePool {
    ctx: Arc<CudaContext>,
    ordinal: i32,
    page: usize,
    free: Vec<CUmemGenericAllocationHandle>,
    /// Pages mapped by more than one buffer: how many buffers beyond the first.
    shared: HashMap<CUmemGenericAllocationHandle, usize>,
    created: usize,
    limit: usize,
}

/// The pool as buffers share it.
pub type SharedPool = Rc<RefCell<PagePool>>;

impl PagePool {
    /// A pool on the context's device holding at most `limit_bytes` (rounded down to pages),
    /// its pages `granules` allocation granules each (at least 1).
    pub fn new(ctx: Arc<CudaContext>, limit_bytes: usize, granules: usize) -> BResult<Self> {
        ctx.bind_to_thread()
            .map_err(|e| BackendError(format!("CUDA context: {e:?}")))?;
        let ordinal = ctx.ordinal() as i32;
        let prop = Self::prop(ordinal);
        let mut page = 0usize;
        check("allocation granularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut page,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        if page == 0 {
            return Err(BackendError("CUDA allocation granularity 0".into()));
        }
        let page = page * granules.max(1);
        Ok(Self {
            ctx,
            ordinal,
            page,
            free: Vec::new(),
            shared: HashMap::new(),
            created: 0,
            limit: limit_bytes / page,
        })
    }

    fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is a valid value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location = location(ordinal);
        prop
    }

    /// Bytes of a page.
    pub fn page_bytes(&self) -> usize {
        self.page
    }

    /// Pages mapped into buffers now.
    pub fn pages_in_use(&self) -> usize {
        self.created - self.free.len()
    }

    /// Pages created so far (in use or free for reuse).
    pub fn pages_created(&self) -> usize {
        self.created
    }

    /// Caps the pool at `limit_bytes` (rounded down to pages): no page is created past it.
    /// Pages already created stay, so a cap below them only stops growth.
    pub fn set_limit(&mut self, limit_bytes: usize) {
        self.limit = limit_bytes / self.page;
    }

    /// One buffer fewer maps page `h`: it is free once none does.
    fn release(&mut self, h: CUmemGenericAllocationHandle) {
        match self.shared.get_mut(&h) {
            Some(1) => {
                self.shared.remove(&h);
            }
            Some(n) => *n -= 1,
            None => self.free.push(h),
        }
    }

    fn take(&mut self) -> BResult<CUmemGenericAllocationHandle> {
        if let Some(h) = self.free.pop() {
            return Ok(h);
        }
        if self.created >= self.limit {
            return Err(BackendError(format!(
                "the cache memory pool is full: {} pages of {} MiB in use",
                self.created,
                self.page >> 20
            )));
        }
        let prop = Self::prop(self.ordinal);
        let mut h: CUmemGenericAllocationHandle = 0;
        check(
            &format!(
                "creating a {} MiB cache page ({} in use)",
                self.page >> 20,
                self.created
            ),
            unsafe { sys::cuMemCreate(&mut h, self.page, &prop, 0) },
        )?;
        self.created += 1;
        Ok(h)
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            for h in self.free.drain(..) {
                // SAFETY: a handle this pool created and no buffer maps.
                unsafe { sys::cuMemRelease(h) };
            }
        }
    }
}

/// A buffer in the pool: `reserved` bytes of addresses at `base`, the first
/// `pages.len()` pages of them mapped. Its address changes when it outgrows the range
/// (`ensure`): take `ptr` after growing.
pub struct PagedBuf {
    pool: SharedPool,
    stream: Arc<CudaStream>,
    base: CUdeviceptr,
    reserved: usize,
    pages: Vec<CUmemGenericAllocationHandle>,
}

impl PagedBuf {
    /// Reserves addresses for `bytes` (at least a page); nothing is mapped yet.
    pub fn new(pool: &SharedPool, stream: &Arc<CudaStream>, bytes: usize) -> BResult<Self> {
        let page = pool.borrow().page;
        let reserved = bytes.max(1).div_ceil(page) * page;
        let base = reserve_addresses(reserved, page)?;
        Ok(Self {
            pool: pool.clone(),
            stream: stream.clone(),
            base,
            reserved,
            pages: Vec::new(),
        })
    }

    /// A buffer whose first `pages` pages are `src`'s (mapped again, read by both; neither
    /// may write them while the other reads them), with addresses for as many bytes as `src`
    /// reserves. Grow it with [`PagedBuf::ensure`].
    pub fn share_prefix(src: &PagedBuf, pages: usize) -> BResult<Self> {
        if pages > src.pages.len() {
            return Err(BackendError(format!(
                "sharing {pages} pages of a buffer of {}",
                src.pages.len()
            )));
        }
        let mut buf = Self::new(&src.pool, &src.stream, src.reserved)?;
        let mut pool = src.pool.borrow_mut();
        let (page, rw) = (pool.page, access(pool.ordinal));
        for &h in &src.pages[..pages] {
            let at = buf.base + (buf.pages.len() * page) as u64;
            check("mapping a shared cache page", unsafe {
                sys::cuMemMap(at, page, 0, h, 0)
            })?;
            // Mapped: from here the buffer holds the page (its drop unmaps and releases it).
            *pool.shared.entry(h).or_insert(0) += 1;
            buf.pages.push(h);
        }
        drop(pool);
        // One access call for the whole mapped range (one a page costs ~50 us at 1M tokens).
        if pages > 0 {
            check("shared cache page access", unsafe {
                sys::cuMemSetAccess(buf.base, pages * page, &rw, 1)
            })?;
        }
        Ok(buf)
    }

    /// The device address of the buffer's first byte.
    pub fn ptr(&self) -> u64 {
        self.base
    }

    /// Bytes mapped (usable) now.
    pub fn mapped(&self) -> usize {
        self.pages.len() * self.pool.borrow().page
    }

    /// Maps pages until at least `bytes` are usable (first moving the pages to a range at
    /// least twice as large when `bytes` is past this one); an error, with nothing lost, when
    /// the pool is full.
    pub fn ensure(&mut self, bytes: usize) -> BResult<()> {
        if bytes > self.reserved {
            self.move_to(bytes.max(2 * self.reserved))?;
        }
        let mut pool = self.pool.borrow_mut();
        let page = pool.page;
        let rw = access(pool.ordinal);
        while self.pages.len() * page < bytes {
            let h = pool.take()?;
            let at = self.base + (self.pages.len() * page) as u64;
            let mapped = check("mapping a cache page", unsafe {
                sys::cuMemMap(at, page, 0, h, 0)
            })
            .and_then(|_| {
                check("cache page access", unsafe {
                    sys::cuMemSetAccess(at, page, &rw, 1)
                })
            });
            if let Err(e) = mapped {
                // SAFETY: `at` is unmapped or was just mapped to `h` (unmapping it is harmless).
                unsafe { sys::cuMemUnmap(at, page) };
                pool.free.push(h);
                return Err(e);
            }
            self.pages.push(h);
        }
        Ok(())
    }
}

impl PagedBuf {
    /// Maps this buffer's pages, in order, into a new range of `bytes` (rounded up to pages),
    /// then, once queued work is done with them, drops the old range.
    fn move_to(&mut self, bytes: usize) -> BResult<()> {
        let (page, ordinal) = {
            let pool = self.pool.borrow();
            (pool.page, pool.ordinal)
        };
        let reserved = bytes.div_ceil(page) * page;
        let base = reserve_addresses(reserved, page)?;
        let mapped = self.pages.len() * page;
        let mut done = 0;
        let mut result = Ok(());
        for (i, &h) in self.pages.iter().enumerate() {
            result = check("mapping a cache page", unsafe {
                sys::cuMemMap(base + (i * page) as u64, page, 0, h, 0)
            });
            if result.is_err() {
                break;
            }
            done += 1;
        }
        if result.is_ok() && mapped > 0 {
            let a = access(ordinal);
            result = check("cache page access", unsafe {
                sys::cuMemSetAccess(base, mapped, &a, 1)
            });
        }
        // The old range, or (on failure) the new one, is unmapped and freed.
        let (old, old_size, old_mapped) = if result.is_ok() {
            // Work queued on the stream may still use the old addresses.
            let _ = self.stream.synchronize();
            let old = (self.base, self.reserved, self.pages.len());
            self.base = base;
            self.reserved = reserved;
            old
        } else {
            (base, reserved, done)
        };
        for i in 0..old_mapped {
            // SAFETY: page i of that range is mapped, and no work uses it.
            unsafe { sys::cuMemUnmap(old + (i * page) as u64, page) };
        }
        // SAFETY: a range reserved by this buffer, now unmapped.
        unsafe { sys::cuMemAddressFree(old, old_size) };
        result
    }
}

/// A range of `bytes` of device addresses, aligned to `page`.
fn reserve_addresses(bytes: usize, page: usize) -> BResult<CUdeviceptr> {
    let mut base: CUdeviceptr = 0;
    check(
        &format!("reserving {} MiB of addresses", bytes >> 20),
        unsafe { sys::cuMemAddressReserve(&mut base, bytes, page, 0, 0) },
    )?;
    Ok(base)
}

fn access(ordinal: i32) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

impl Drop for PagedBuf {
    fn drop(&mut self) {
        // Work queued on the stream may still use the pages: let it finish first.
        let _ = self.stream.synchronize();
        let mut pool = self.pool.borrow_mut();
        let page = pool.page;
        for (i, h) in self.pages.drain(..).enumerate() {
            // SAFETY: page i of this buffer's range is mapped to `h`, and no work uses it.
            unsafe { sys::cuMemUnmap(self.base + (i * page) as u64, page) };
            pool.release(h);
        }
        // SAFETY: the range this buffer reserved, now unmapped.
        unsafe { sys::cuMemAddressFree(self.base, self.reserved) };
    }
}
