// Texture objects: point and linear filtering in every address mode, normalized coordinates, read modes,
// channel formats, 1D/2D/3D/layered arrays, pitch-2D and linear memory, tld4 gathers and txq queries.
// The texture's resource and sampling state come from the case file (`resource` and `param tex`
// directives); the kernels only sample a grid of points and store all four components.
//
// Sample points start at (x0, y0, z0) and step by (dx, dy, dz): thread (i, j, k) samples
// (x0 + i*dx, y0 + j*dy, z0 + k*dz) and stores its result at out[(k*ny + j)*nx + i].

extern "C" __global__ void tex1d_f4(cudaTextureObject_t t, float4* out, float x0, float dx, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = tex1D<float4>(t, x0 + i * dx);
    }
}

extern "C" __global__ void tex2d_f4(cudaTextureObject_t t, float4* out, float x0, float dx, float y0,
                                    float dy, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        out[j * nx + i] = tex2D<float4>(t, x0 + i * dx, y0 + j * dy);
    }
}

extern "C" __global__ void tex2d_u4(cudaTextureObject_t t, uint4* out, float x0, float dx, float y0,
                                    float dy, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        out[j * nx + i] = tex2D<uint4>(t, x0 + i * dx, y0 + j * dy);
    }
}

extern "C" __global__ void tex2d_i4(cudaTextureObject_t t, int4* out, float x0, float dx, float y0,
                                    float dy, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        out[j * nx + i] = tex2D<int4>(t, x0 + i * dx, y0 + j * dy);
    }
}

extern "C" __global__ void tex3d_f4(cudaTextureObject_t t, float4* out, float x0, float dx, float y0,
                                    float dy, float z0, float dz, int nx, int ny, int nz)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    int k = blockIdx.z * blockDim.z + threadIdx.z;
    if (i < nx && j < ny && k < nz) {
        out[(k * ny + j) * nx + i] = tex3D<float4>(t, x0 + i * dx, y0 + j * dy, z0 + k * dz);
    }
}

// Layer k of a layered 2D texture (k may lie outside the layers present).
extern "C" __global__ void tex2d_layered_f4(cudaTextureObject_t t, float4* out, float x0, float dx,
                                            float y0, float dy, int nx, int ny, int nz)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    int k = blockIdx.z * blockDim.z + threadIdx.z;
    if (i < nx && j < ny && k < nz) {
        out[(k * ny + j) * nx + i] = tex2DLayered<float4>(t, x0 + i * dx, y0 + j * dy, k);
    }
}

// tex1Dfetch on linear memory, indices first .. first + n - 1 (some outside the buffer).
extern "C" __global__ void tex1dfetch_f4(cudaTextureObject_t t, float4* out, int first, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = tex1Dfetch<float4>(t, first + i);
    }
}

extern "C" __global__ void tex1dfetch_i4(cudaTextureObject_t t, int4* out, int first, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = tex1Dfetch<int4>(t, first + i);
    }
}

// tld4: the four texels of each bilinear footprint, one component at a time: out[4 * point + c].
extern "C" __global__ void tld4_f4(cudaTextureObject_t t, float4* out, float x0, float dx, float y0,
                                   float dy, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        float x = x0 + i * dx;
        float y = y0 + j * dy;
        float4* o = out + 4 * (j * nx + i);
        o[0] = tex2Dgather<float4>(t, x, y, 0);
        o[1] = tex2Dgather<float4>(t, x, y, 1);
        o[2] = tex2Dgather<float4>(t, x, y, 2);
        o[3] = tex2Dgather<float4>(t, x, y, 3);
    }
}

extern "C" __global__ void tld4_u4(cudaTextureObject_t t, uint4* out, float x0, float dx, float y0,
                                   float dy, int nx, int ny)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y * blockDim.y + threadIdx.y;
    if (i < nx && j < ny) {
        float x = x0 + i * dx;
        float y = y0 + j * dy;
        uint4* o = out + 4 * (j * nx + i);
        o[0] = tex2Dgather<uint4>(t, x, y, 0);
        o[1] = tex2Dgather<uint4>(t, x, y, 1);
        o[2] = tex2Dgather<uint4>(t, x, y, 2);
        o[3] = tex2Dgather<uint4>(t, x, y, 3);
    }
}

// txq / suq: width, height, depth of a texture and of a surface.
extern "C" __global__ void tex_query(cudaTextureObject_t t, cudaSurfaceObject_t s, unsigned* out)
{
    unsigned w, h, d, sw, sh, sd;
    asm("txq.width.b32 %0, [%1];" : "=r"(w) : "l"(t));
    asm("txq.height.b32 %0, [%1];" : "=r"(h) : "l"(t));
    asm("txq.depth.b32 %0, [%1];" : "=r"(d) : "l"(t));
    asm("suq.width.b32 %0, [%1];" : "=r"(sw) : "l"(s));
    asm("suq.height.b32 %0, [%1];" : "=r"(sh) : "l"(s));
    asm("suq.depth.b32 %0, [%1];" : "=r"(sd) : "l"(s));
    out[0] = w;
    out[1] = h;
    out[2] = d;
    out[3] = sw;
    out[4] = sh;
    out[5] = sd;
}
